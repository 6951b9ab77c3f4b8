//! Command-line arguments shared by the roles. Every flag also reads an environment
//! variable (`ELASTICPS_...`), so a launcher or a Kubernetes manifest can configure a
//! role without a command line. The job's own flags live in `elasticps-run` (below the
//! I/O crates, so the sim shares them); they are re-exported here.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use rand::{RngCore, SeedableRng};

use crate::LaunchError;
use elasticps_runtime::RuntimeError;
use elasticps_runtime::tls::{TlsConfig, TlsPart};
use elasticps_wire::Codec;

pub use elasticps_run::args::{DataArgs, JobArgs, RunArgs, StragglerSpec};

/// Cluster-wide transport settings; every node of a job must agree on them.
#[derive(Args, Clone, Debug)]
pub struct NetArgs {
    /// Shared cluster secret: every connection opens with an HMAC-SHA256 challenge-response
    /// over it (authentication, not encryption).
    #[arg(long, env = "ELASTICPS_SECRET", default_value = "", hide_env_values = true)]
    pub secret: String,
    /// Largest frame payload accepted, in MiB.
    #[arg(long, env = "ELASTICPS_MAX_FRAME_MIB", default_value_t = 64)]
    pub max_frame_mib: u32,
    /// Drop a peer that stalls this long in the middle of a frame or of the handshake
    /// (seconds; the handshake's own limit is 10 s).
    #[arg(long, env = "ELASTICPS_FRAME_TIMEOUT_S", default_value_t = 30.0, value_parser = positive_seconds)]
    pub frame_timeout_s: f64,
    /// Most connections a scheduler or server keeps open at once (workers, servers,
    /// operator tools); one more is closed at once and logged.
    #[arg(long, env = "ELASTICPS_MAX_CONNECTIONS", value_name = "N", default_value_t = 4096, value_parser = at_least_one)]
    pub max_connections: usize,
    /// Most connections a scheduler or server keeps in the handshake at once (each for
    /// 10 s at most); they do not count against --max-connections, so peers without the
    /// secret cannot take the places of authenticated ones.
    #[arg(long, env = "ELASTICPS_MAX_HANDSHAKES", value_name = "N", default_value_t = 1024, value_parser = at_least_one)]
    pub max_handshakes: usize,
    /// Most memory, in MiB, that partial frames (payloads whose last byte has not come)
    /// may hold in a node at once: a frame that would pass it takes the place of the
    /// partial frames that went longest without a byte, whose connections are closed.
    #[arg(long, env = "ELASTICPS_MAX_PARTIAL_MIB", value_name = "MIB", default_value_t = 1024, value_parser = at_least_one)]
    pub max_partial_mib: usize,
    /// A second secret for workers only: schedulers and servers given it also accept
    /// workers that prove it, and a worker given it (and no --secret) dials with it. A
    /// worker-secret connection can register only as a worker and prove only a worker's
    /// credential, so a compromised training script cannot become a server.
    #[arg(long, env = "ELASTICPS_WORKER_SECRET", hide_env_values = true)]
    pub worker_secret: Option<String>,
    /// TLS: this node's certificate chain (PEM, leaf first). With --tls-key and --tls-ca
    /// every connection is mutual TLS 1.3 (the HMAC handshake runs inside it); all three
    /// or none. One certificate serves both ends: its extended key usage, if any, must
    /// allow serverAuth and clientAuth. Peers' chains are checked against --tls-ca, not
    /// their names (docs/MANUAL.md, "TLS").
    #[arg(long, env = "ELASTICPS_TLS_CERT", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// TLS: the private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "ELASTICPS_TLS_KEY", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// TLS: the cluster's CA certificates (PEM). A peer must present a certificate they
    /// signed, on either end of a connection.
    #[arg(long, env = "ELASTICPS_TLS_CA", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// A server or worker that loses the scheduler retries it (backoff 100 ms doubling to
    /// 2 s) for this long before it gives up: a scheduler restarted with --state-dir is
    /// reattached (0: never retry).
    #[arg(long, env = "ELASTICPS_SCHEDULER_RETRY_S", default_value_t = 60.0)]
    pub scheduler_retry_s: f64,
}

/// A count of at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(v) if v >= 1 => Ok(v),
        _ => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}

/// A duration in seconds: finite and above 0.
fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

impl NetArgs {
    /// The frame codec these settings describe: the cluster secret's, also accepting
    /// dialers of the worker secret (schedulers and servers).
    pub fn codec(&self) -> Codec {
        Codec::new(self.secret.as_bytes(), self.max_frame_mib.saturating_mul(1 << 20))
            .with_worker_secret(self.worker_secret().map(str::as_bytes))
    }

    /// The worker secret, if one is set (an empty one is none).
    pub fn worker_secret(&self) -> Option<&str> {
        self.worker_secret.as_deref().filter(|ws| !ws.is_empty())
    }

    /// Refuses a worker secret that would protect nothing: without a cluster secret (the
    /// empty key would let anyone be a server) or equal to it. Schedulers and servers
    /// call it; a worker may hold the worker secret alone.
    pub fn check_worker_secret(&self) -> crate::Result<()> {
        match self.worker_secret() {
            Some(_) if self.secret.is_empty() => Err(crate::LaunchError::Flags(
                "--worker-secret needs a --secret too: without a cluster secret anyone could be a server".into(),
            )),
            Some(ws) if ws == self.secret => {
                Err(crate::LaunchError::Flags("--worker-secret must differ from --secret".into()))
            }
            _ => Ok(()),
        }
    }

    /// These settings for a launch of the user's own scripts (`elasticps launch`): the
    /// scripts hold a worker secret of their own, never the cluster secret.
    /// - Without `--worker-secret`, it is derived from the cluster secret
    ///   ([`elasticps_wire::credential::derived_worker_secret`]): every host of a job
    ///   derives the same one.
    /// - Without a cluster secret on one host, the job's nodes get a random one (a worker
    ///   secret beside the empty cluster secret would protect nothing). Across hosts the
    ///   secret is left empty: the launch then refuses to start, saying what to set.
    ///
    /// Returns whether the cluster secret was drawn here (operator tools cannot reach the
    /// job without it).
    pub fn secure_for_scripts(&mut self, spans_hosts: bool) -> bool {
        let drawn = self.secret.is_empty() && !spans_hosts;
        if drawn {
            let mut bytes = [0u8; 16];
            rand::rngs::StdRng::from_os_rng().fill_bytes(&mut bytes);
            self.secret = bytes.iter().map(|b| format!("{b:02x}")).collect();
        }
        if self.worker_secret().is_none() && !self.secret.is_empty() {
            self.worker_secret = Some(elasticps_wire::credential::derived_worker_secret(self.secret.as_bytes()));
        }
        drawn
    }

    /// The codec a worker dials with: the worker secret's when it has one and no cluster
    /// secret, else the cluster secret's ([`Codec::for_worker`]).
    pub fn worker_codec(&self) -> Codec {
        let max_payload = self.max_frame_mib.saturating_mul(1 << 20);
        Codec::for_worker(self.secret.as_bytes(), self.worker_secret().map(str::as_bytes), max_payload)
    }

    /// The secrets a role process started by a launcher gets, as environment variables
    /// (never on its command line): `ELASTICPS_SECRET`, and `ELASTICPS_WORKER_SECRET` if
    /// there is one.
    pub fn role_env(&self) -> Vec<(&'static str, &str)> {
        let mut env = vec![("ELASTICPS_SECRET", self.secret.as_str())];
        if let Some(ws) = self.worker_secret() {
            env.push(("ELASTICPS_WORKER_SECRET", ws));
        }
        env
    }

    /// How long a started frame (or handshake) may stall before its peer is dropped.
    pub fn frame_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.frame_timeout_s)
    }

    /// How long a node retries a lost scheduler.
    pub fn scheduler_retry(&self) -> std::time::Duration {
        std::time::Duration::try_from_secs_f64(self.scheduler_retry_s).unwrap_or_default()
    }

    /// The TLS settings of --tls-cert, --tls-key and --tls-ca, read from their files
    /// (`None` without them). All three or none; an unusable file is an error naming it and
    /// its flag.
    pub fn tls(&self) -> crate::Result<Option<Arc<TlsConfig>>> {
        let (cert, key, ca) = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => return Ok(None),
            (Some(c), Some(k), Some(a)) => (c, k, a),
            _ => {
                let given: Vec<&str> =
                    [("--tls-cert", &self.tls_cert), ("--tls-key", &self.tls_key), ("--tls-ca", &self.tls_ca)]
                        .into_iter()
                        .filter_map(|(flag, v)| v.as_ref().map(|_| flag))
                        .collect();
                return Err(LaunchError::Flags(format!(
                    "TLS needs --tls-cert, --tls-key and --tls-ca together; only {} given",
                    given.join(" and ")
                )));
            }
        };
        TlsConfig::from_files(cert, key, ca).map(|c| Some(Arc::new(c))).map_err(|e| match e {
            RuntimeError::TlsSetup { part, path, what } => {
                let flag = match part {
                    TlsPart::Cert => "--tls-cert",
                    TlsPart::Key => "--tls-key",
                    TlsPart::Ca => "--tls-ca",
                };
                LaunchError::Flags(format!("{flag} {path}: {what}"))
            }
            other => LaunchError::Flags(other.to_string()),
        })
    }

    /// Makes these settings the process's transport (before it dials or accepts): TLS
    /// ([`NetArgs::tls`]) on every connection or none, and --max-connections on its
    /// acceptors.
    pub fn install(&self) -> crate::Result<()> {
        let tls = self.tls()?;
        tracing::info!(tls = tls.is_some(), max_connections = self.max_connections, "transport");
        elasticps_runtime::tls::install(tls);
        elasticps_runtime::accept::set_max_connections(self.max_connections);
        elasticps_runtime::accept::set_max_handshakes(self.max_handshakes);
        elasticps_runtime::partial::set_max_partial_bytes((self.max_partial_mib as u64).saturating_mul(1 << 20));
        Ok(())
    }

    /// `ELASTICPS_TLS_CERT`, `ELASTICPS_TLS_KEY` and `ELASTICPS_TLS_CA` (absolute paths) for
    /// a user's worker command, when TLS is on.
    pub fn tls_env(&self) -> Vec<(String, String)> {
        let vars = [
            ("ELASTICPS_TLS_CERT", &self.tls_cert),
            ("ELASTICPS_TLS_KEY", &self.tls_key),
            ("ELASTICPS_TLS_CA", &self.tls_ca),
        ];
        vars.into_iter()
            .filter_map(|(k, p)| {
                p.as_ref().map(|p| {
                    (k.to_string(), std::path::absolute(p).unwrap_or_else(|_| p.clone()).display().to_string())
                })
            })
            .collect()
    }

    /// The flags that reproduce these settings on a child process (TLS files as absolute
    /// paths, so a child in another directory finds them).
    pub fn to_flags(&self) -> Vec<String> {
        let mut f = vec![
            "--max-frame-mib".into(),
            self.max_frame_mib.to_string(),
            "--frame-timeout-s".into(),
            self.frame_timeout_s.to_string(),
            "--max-connections".into(),
            self.max_connections.to_string(),
            "--max-handshakes".into(),
            self.max_handshakes.to_string(),
            "--max-partial-mib".into(),
            self.max_partial_mib.to_string(),
            "--scheduler-retry-s".into(),
            self.scheduler_retry_s.to_string(),
        ];
        for (flag, path) in [("--tls-cert", &self.tls_cert), ("--tls-key", &self.tls_key), ("--tls-ca", &self.tls_ca)] {
            if let Some(p) = path {
                let p = std::path::absolute(p).unwrap_or_else(|_| p.clone());
                f.extend([flag.to_string(), p.display().to_string()]);
            }
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Net {
        #[command(flatten)]
        net: NetArgs,
    }

    /// The transport settings of these flags.
    fn parse(flags: &[&str]) -> NetArgs {
        Net::try_parse_from(std::iter::once("x").chain(flags.iter().copied())).unwrap().net
    }

    /// The value of variable `k` in `env`.
    fn get(env: &[(String, String)], k: &str) -> Option<String> {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn a_worker_secret_goes_to_the_script_alone_and_needs_a_cluster_secret_of_its_own() {
        let job = JobArgs::default();
        let both = parse(&["--secret", "cluster", "--worker-secret", "workers"]);
        assert!(both.check_worker_secret().is_ok());
        let env = crate::runner::worker_env(&job, &both, "h:1", 0);
        assert_eq!(get(&env, "ELASTICPS_SECRET").as_deref(), Some(""), "the script never sees the cluster secret");
        assert_eq!(get(&env, "ELASTICPS_WORKER_SECRET").as_deref(), Some("workers"));
        assert_eq!(both.role_env(), [("ELASTICPS_SECRET", "cluster"), ("ELASTICPS_WORKER_SECRET", "workers")]);
        let plain = parse(&["--secret", "cluster"]);
        let env = crate::runner::worker_env(&job, &plain, "h:1", 0);
        assert_eq!(get(&env, "ELASTICPS_SECRET").as_deref(), Some("cluster"));
        assert_eq!(get(&env, "ELASTICPS_WORKER_SECRET"), None);
        let alone = parse(&["--worker-secret", "workers"]);
        assert!(alone.check_worker_secret().unwrap_err().to_string().contains("needs a --secret"));
        assert_eq!(alone.worker_codec().key(), elasticps_wire::KeyId::Worker, "a worker dials with it alone");
        let same = parse(&["--secret", "s", "--worker-secret", "s"]);
        assert!(same.check_worker_secret().unwrap_err().to_string().contains("must differ"));
    }

    #[test]
    fn a_launch_gives_its_scripts_a_worker_secret_and_never_the_cluster_secret() {
        let job = JobArgs::default();
        // A cluster secret alone: the scripts get the worker secret derived from it.
        let mut given = parse(&["--secret", "cluster"]);
        assert!(!given.secure_for_scripts(true));
        assert!(given.check_worker_secret().is_ok());
        let env = crate::runner::worker_env(&job, &given, "h:1", 0);
        assert_eq!(get(&env, "ELASTICPS_SECRET").as_deref(), Some(""), "the script never sees the cluster secret");
        let derived = elasticps_wire::credential::derived_worker_secret(b"cluster");
        assert_eq!(get(&env, "ELASTICPS_WORKER_SECRET"), Some(derived));
        // The user's own worker secret is kept.
        let mut own = parse(&["--secret", "cluster", "--worker-secret", "mine"]);
        own.secure_for_scripts(false);
        assert_eq!(own.worker_secret(), Some("mine"));
        // No secret on one host: a random cluster secret, a worker secret derived from it.
        let (mut a, mut b) = (parse(&[]), parse(&[]));
        assert!(a.secure_for_scripts(false) && b.secure_for_scripts(false));
        assert_eq!(a.secret.len(), 32);
        assert_ne!(a.secret, b.secret, "drawn per job");
        assert!(a.check_worker_secret().is_ok());
        assert_eq!(get(&crate::runner::worker_env(&job, &a, "h:1", 0), "ELASTICPS_SECRET").as_deref(), Some(""));
        // No secret across hosts: left empty, for the launch to refuse.
        let mut hosts = parse(&[]);
        assert!(!hosts.secure_for_scripts(true));
        assert_eq!((hosts.secret.as_str(), hosts.worker_secret()), ("", None));
    }

    #[test]
    fn the_frame_timeout_is_a_positive_number_of_seconds_and_reaches_child_processes() {
        let parse = |f: &[&str]| Net::try_parse_from(std::iter::once("x").chain(f.iter().copied())).map(|n| n.net);
        assert_eq!(parse(&[]).unwrap().frame_timeout(), std::time::Duration::from_secs(30));
        let n = parse(&["--frame-timeout-s", "2.5"]).unwrap();
        assert_eq!(n.frame_timeout(), std::time::Duration::from_millis(2500));
        assert!(n.to_flags().windows(2).any(|w| w == ["--frame-timeout-s", "2.5"]));
        for bad in ["0", "-1", "inf", "soon"] {
            let e = parse(&[&format!("--frame-timeout-s={bad}")]).unwrap_err().to_string();
            assert!(e.contains("not a positive number of seconds"), "{bad}: {e}");
        }
    }

    #[test]
    fn tls_takes_all_three_files_or_none_names_the_flag_of_a_bad_file_and_reaches_child_processes() {
        #[derive(Parser, Debug)]
        struct Net {
            #[command(flatten)]
            net: NetArgs,
        }
        let parse = |f: &[&str]| Net::try_parse_from(std::iter::once("x").chain(f.iter().copied())).map(|n| n.net);
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../cli/tests/data/tls");
        let file = |name: &str| dir.join(name).display().to_string();
        let (cert, key, ca) = (file("node.pem"), file("node.key"), file("ca.pem"));

        let none = parse(&[]).unwrap();
        assert!(none.tls().unwrap().is_none());
        assert_eq!(none.max_connections, 4096);
        assert!(!none.to_flags().iter().any(|f| f.starts_with("--tls")));

        let all = parse(&["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &ca, "--max-connections", "9"]).unwrap();
        assert!(all.tls().unwrap().is_some());
        let again = parse(&all.to_flags().iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(again.to_flags(), all.to_flags());
        assert_eq!(again.max_connections, 9);
        assert!(again.tls().unwrap().is_some(), "a child gets working --tls-* flags");

        let e = parse(&["--tls-cert", &cert, "--tls-ca", &ca]).unwrap().tls().unwrap_err().to_string();
        assert!(e.contains("--tls-cert, --tls-key and --tls-ca together; only --tls-cert and --tls-ca given"), "{e}");
        let missing = file("missing.key");
        let e = parse(&["--tls-cert", &cert, "--tls-key", &missing, "--tls-ca", &ca]).unwrap().tls().unwrap_err();
        assert!(e.to_string().starts_with(&format!("--tls-key {missing}: cannot read it")), "{e}");
        let e = parse(&["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &key]).unwrap().tls().unwrap_err();
        assert!(e.to_string().starts_with(&format!("--tls-ca {key}: no PEM CERTIFICATE block")), "{e}");
        let e = parse(&["--max-connections", "0"]).unwrap_err().to_string();
        assert!(e.contains("not a whole number of at least 1"), "{e}");
    }
}
