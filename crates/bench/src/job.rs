//! The one train-job runner of `bench sync` and `bench straggler`: a job given as
//! `elasticps train` flags runs on a real local cluster through `elasticps-launch` (the
//! runner `elasticps train` itself uses), quietly, with the benchmark's transport settings
//! and its nodes' logs under the run's directory.

use std::path::Path;

use clap::Parser;
use elasticps_launch::args::NetArgs;
use elasticps_launch::train::{TrainCmd, build_report, run_local};
use elasticps_report::Report;

use crate::{BenchError, Result};

/// `elasticps train`'s flags, parsed into its command (so every flag not given keeps the
/// default of `train`).
#[derive(Parser, Debug)]
#[command(name = "train")]
struct TrainFlags {
    #[command(flatten)]
    cmd: TrainCmd,
}

/// `flags` (as `elasticps train` takes them) parsed into the train command.
pub fn train_cmd(flags: &[String]) -> Result<TrainCmd> {
    TrainFlags::try_parse_from(std::iter::once("train".to_string()).chain(flags.iter().cloned()))
        .map(|f| f.cmd)
        .map_err(|e| BenchError::Flags(format!("building the job: {e}")))
}

/// Runs the train job of `flags` with the transport settings `net`, without progress bars,
/// the nodes' logs in `dir/logs`; returns its report (writing it is the caller's choice).
pub async fn run_train(flags: &[String], net: &NetArgs, dir: &Path) -> Result<Report> {
    let mut train = train_cmd(flags)?;
    train.net = net.clone();
    train.run.quiet = true;
    // Only the nodes' logs go there: run_local writes no report itself.
    train.run.report = Some(dir.to_path_buf());
    let outcome = run_local(&train, &[]).await?;
    Ok(build_report(&train, &outcome)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_keep_the_defaults_of_train_and_refuse_unknown_ones() {
        let flags = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let t = train_cmd(&flags(&["--servers", "3", "--sync", "ssp:2"])).unwrap();
        assert_eq!(t.job.servers, 3);
        assert_eq!(t.job.sync.to_string(), "ssp:2");
        assert!(!t.run.quiet && t.run.report.is_none());
        let err = train_cmd(&flags(&["--no-such-flag"])).unwrap_err();
        assert!(matches!(err, BenchError::Flags(_)) && err.to_string().starts_with("building the job: "), "{err}");
    }
}
