//! `elasticps._native.cli_main(argv, self_command)`: the `elasticps` command (launch,
//! scheduler, server, bench, everything), the same program as the `elasticps` binary, linked
//! into the module so that `pip install` gives the command (`python/elasticps/__main__.py`).

use std::ffi::OsString;

use pyo3::prelude::*;

/// Runs `elasticps ARGV[1:]` with the GIL released and returns its exit status.
/// `self_command` starts this program again (`[sys.executable, "-m", "elasticps"]`): the
/// launchers start their scheduler, servers and workers with it.
#[pyfunction]
pub fn cli_main(py: Python<'_>, argv: Vec<OsString>, self_command: Vec<OsString>) -> i32 {
    elasticps_cli::set_self_command(self_command);
    i32::from(py.detach(|| elasticps_cli::main_with_args(argv)))
}
