//! Credentials: who a node is, bound to the cluster secret (docs/PROTOCOL.md §1.3).
//!
//! The handshake proves that a peer holds a secret; it does not say which node it is.
//! The scheduler gives every node it registers a [`Credential`] for its role and id (a
//! server's id, a worker's rank) in its `Welcome`: an HMAC-SHA256, keyed with the cluster
//! secret, over the job, the role and the id. The node presents it in the `Hello` of each
//! data connection it opens, and servers check it with the same secret. A worker that
//! holds only the worker secret (`--worker-secret`) cannot make a credential, so it can be
//! no other worker and no server.
//!
//! ```
//! # use elasticps_wire::credential::*;
//! let c = Credential::issue(b"s3cret", 42, PeerRole::Worker, 1);
//! assert!(c.verify(b"s3cret").is_ok());
//! assert!(c.verify(b"other").is_err());
//! ```

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::error::WireError;

/// Bytes of a credential's MAC.
pub const MAC_LEN: usize = 32;

/// The domain of a credential's MAC (ASCII, no terminator).
const DOMAIN: &[u8] = b"elasticps credential";

/// The role a credential is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum PeerRole {
    /// A worker; the id is its rank.
    Worker,
    /// A server; the id is its server id.
    Server,
}

impl PeerRole {
    /// The role's byte in the MAC: 0 worker, 1 server (its postcard tag too).
    pub fn byte(self) -> u8 {
        match self {
            PeerRole::Worker => 0,
            PeerRole::Server => 1,
        }
    }
}

/// A node's identity in one job, as the scheduler issued it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credential {
    /// The job (a random number the scheduler drew when the job started).
    pub job: u64,
    /// The node's role.
    pub role: PeerRole,
    /// The server id or the worker rank.
    pub id: u32,
    /// `HMAC-SHA256(secret, "elasticps credential" | job u64 LE | role u8 | id u32 LE)`.
    pub mac: [u8; MAC_LEN],
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The MAC is a bearer token: never printed.
        write!(f, "Credential({self}, job {:016x})", self.job)
    }
}

fn role_name(role: PeerRole) -> &'static str {
    match role {
        PeerRole::Worker => "worker",
        PeerRole::Server => "server",
    }
}

impl std::fmt::Display for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", role_name(self.role), self.id)
    }
}

fn mac(secret: &[u8], job: u64, role: PeerRole, id: u32) -> Hmac<Sha256> {
    // HMAC takes a key of any length (an empty secret too).
    let mut m = Hmac::<Sha256>::new_from_slice(secret).unwrap_or_else(|_| unreachable!("hmac keys have any length"));
    m.update(DOMAIN);
    m.update(&job.to_le_bytes());
    m.update(&[role.byte()]);
    m.update(&id.to_le_bytes());
    m
}

impl Credential {
    /// The credential of `role` `id` in `job`, made with the cluster `secret`.
    pub fn issue(secret: &[u8], job: u64, role: PeerRole, id: u32) -> Self {
        let mac = mac(secret, job, role, id).finalize().into_bytes().into();
        Credential { job, role, id, mac }
    }

    /// Checks the MAC with the cluster `secret` (in constant time).
    pub fn verify(&self, secret: &[u8]) -> Result<(), WireError> {
        mac(secret, self.job, self.role, self.id).verify_slice(&self.mac).map_err(|_| {
            WireError::BadCredential(format!("the credential of {self} was not made with this cluster's secret"))
        })
    }

    /// Checks the MAC and that the credential is of `job`.
    pub fn verify_for(&self, secret: &[u8], job: u64) -> Result<(), WireError> {
        self.verify(secret)?;
        if self.job != job {
            return Err(WireError::BadCredential(format!(
                "the credential of {self} is of job {:016x}, not of this job {job:016x}",
                self.job
            )));
        }
        Ok(())
    }
}

/// The domain of a worker secret derived from the cluster secret.
const WORKER_SECRET_DOMAIN: &[u8] = b"elasticps worker secret";

/// The worker secret a launch derives from the cluster `secret` when it is given none
/// (`--worker-secret`): `HMAC-SHA256(secret, "elasticps worker secret")` in lowercase hex.
/// Every host of a job derives the same one, and a holder of it cannot go back to the
/// cluster secret.
pub fn derived_worker_secret(secret: &[u8]) -> String {
    let mut m = Hmac::<Sha256>::new_from_slice(secret).unwrap_or_else(|_| unreachable!("hmac keys have any length"));
    m.update(WORKER_SECRET_DOMAIN);
    m.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_derived_worker_secret_is_the_same_for_one_secret_and_differs_from_it() {
        let ws = derived_worker_secret(b"cluster");
        assert_eq!(ws, derived_worker_secret(b"cluster"), "every host derives the same one");
        assert_ne!(ws, derived_worker_secret(b"cluster2"));
        assert_eq!(ws.len(), 64);
        assert!(!ws.contains("cluster"));
    }

    #[test]
    fn a_credential_binds_job_role_and_id() {
        let c = Credential::issue(b"k", 7, PeerRole::Server, 3);
        assert!(c.verify_for(b"k", 7).is_ok());
        assert!(c.verify_for(b"k", 8).unwrap_err().to_string().contains("not of this job"));
        for forged in [
            Credential { id: 4, ..c.clone() },
            Credential { role: PeerRole::Worker, ..c.clone() },
            Credential { job: 8, ..c.clone() },
        ] {
            assert!(forged.verify(b"k").is_err(), "{forged:?}");
        }
        assert_eq!(format!("{c:?}"), "Credential(server 3, job 0000000000000007)", "the MAC is never printed");
    }
}
