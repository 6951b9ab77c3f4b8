//! The one pipeline of every `elasticps bench <name>`: a [`Bench`] runs its plan and
//! returns what it measured; [`execute`] wraps that with the command line, the machine
//! ([`MachineWatch`]) and the time taken ([`Written`]), decides the checks and targets,
//! prints the Markdown, writes `STEM.json`, `STEM.md` and the plots, and fails the command
//! when a check failed.

use std::future::Future;
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use crate::checks::{Check, Target, ensure_no_check_failed};
use crate::error::Context as _;
use crate::machine::{Machine, MachineWatch};

/// One benchmark: its plan resolved from its flags, its runs, its verdicts, its Markdown
/// and plots.
pub trait Bench {
    /// The files' stem: `bench-sync` writes `bench-sync.json` and `bench-sync.md`.
    const STEM: &'static str;
    /// The benchmark keeps every run's reports and logs under `runs/` in its directory.
    const RUNS_DIR: bool = false;
    /// What the runs measured: the body of the JSON.
    type Body: Serialize;

    /// Where the files go (`None`: print only).
    fn out(&self) -> Option<&Path>;

    /// Runs the plan.
    fn run(&self) -> impl Future<Output = crate::Result<Self::Body>>;

    /// The checks (a failed one fails the command) and the targets (reported).
    fn verdicts(&self, body: &Self::Body) -> (Vec<Check>, Vec<Target>);

    /// The Markdown the command prints and writes.
    fn markdown(&self, written: &Written<Self::Body>) -> String;

    /// The command's failure when a check failed (default: how many failed; a benchmark
    /// may name what failed, e.g. the suite's seeds).
    fn failure(&self, checks: &[Check]) -> crate::Result<()> {
        ensure_no_check_failed(checks)
    }

    /// Draws the figures into `dir`; returns their file names.
    fn plots(&self, _written: &Written<Self::Body>, _dir: &Path) -> crate::Result<Vec<String>> {
        Ok(Vec::new())
    }
}

/// Everything a benchmark writes into its JSON.
#[derive(Clone, Debug, Serialize)]
pub struct Written<B> {
    /// The command line.
    pub command: String,
    /// The machine, and what other processes took of it meanwhile.
    pub machine: Machine,
    /// Seconds the runs took.
    pub took_s: f64,
    /// What the runs measured.
    #[serde(flatten)]
    pub body: B,
    /// The checks.
    pub checks: Vec<Check>,
    /// The targets.
    pub targets: Vec<Target>,
}

impl<B> Written<B> {
    /// The Markdown's heading: the title, the command line and the machine paragraph.
    pub fn heading(&self, title: &str) -> String {
        format!("## {title}\n\n`{}`\n\n{}", self.command, self.machine.markdown(self.took_s))
    }
}

/// Runs `bench` through the pipeline (module docs).
pub async fn execute<B: Bench>(bench: B) -> crate::Result<()> {
    if let Some(out) = bench.out() {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    }
    let watch = MachineWatch::start();
    let started = Instant::now();
    let body = bench.run().await?;
    let took_s = started.elapsed().as_secs_f64();
    let (checks, targets) = bench.verdicts(&body);
    let written = Written {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: watch.finish(),
        took_s,
        body,
        checks,
        targets,
    };
    let md = bench.markdown(&written);
    print!("{md}");
    if let Some(out) = bench.out() {
        let (json, md_name) = (format!("{}.json", B::STEM), format!("{}.md", B::STEM));
        std::fs::write(out.join(&json), elasticps_report::to_json(&written)? + "\n")
            .with_context(|| format!("writing {json}"))?;
        std::fs::write(out.join(&md_name), &md).with_context(|| format!("writing {md_name}"))?;
        let mut files = vec![json, md_name];
        files.extend(bench.plots(&written, out)?);
        if B::RUNS_DIR {
            files.push("runs/".into());
        }
        println!("\nwritten to {} ({})", out.display(), files.join(", "));
    }
    bench.failure(&written.checks)
}

/// Draws the figure `name` into `dir` with `draw`; returns its name.
pub fn draw(
    dir: &Path,
    name: &str,
    draw: impl FnOnce(&Path) -> elasticps_report::Result<()>,
) -> crate::Result<Vec<String>> {
    let png = dir.join(name);
    draw(&png).with_context(|| format!("drawing {}", png.display()))?;
    Ok(vec![name.to_string()])
}
