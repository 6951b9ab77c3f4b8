//! `elasticps`: the parameter server's command-line binary (the program is the
//! `elasticps_cli` library, which the Python package's `elasticps` command runs too).

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(elasticps_cli::main_with_args(std::env::args_os()))
}
