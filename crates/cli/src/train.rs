//! `elasticps train`: the main job. Starts a whole local cluster (scheduler, servers,
//! workers as separate processes on 127.0.0.1), shows progress, prints a summary and
//! writes the report.

use elasticps_launch::runner::print_cluster_summary;
pub use elasticps_launch::train::{TrainCmd, build_report, run_local};

/// `elasticps train`: run, print the summary, write the report.
pub async fn train(cmd: TrainCmd) -> anyhow::Result<()> {
    let outcome = run_local(&cmd, &[]).await?;
    let report = build_report(&cmd, &outcome)?;
    if report.test_accuracy.is_nan() {
        println!("{} iterations per worker (synthetic model: no test set)", report.iterations);
    } else {
        println!(
            "test accuracy {:.2}% (loss {:.4}) after {} iterations per worker",
            report.test_accuracy * 100.0,
            report.test_loss,
            report.iterations
        );
    }
    print_cluster_summary(&cmd.job, &report);
    if let Some(dir) = &cmd.run.report {
        elasticps_report::write(dir, &report)?;
        println!("report written to {}", dir.display());
    }
    Ok(())
}
