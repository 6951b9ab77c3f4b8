//! A job's scheduler and servers as processes of this binary, for the benchmarks that
//! drive their own workers in process (`bench transport`, `bench chaos`): each role's
//! command line is its typed job ([`JobArgs::to_flags`]) and the cluster's transport
//! settings ([`NetArgs::to_flags`]).

use std::time::Duration;

use elasticps_launch::args::{JobArgs, NetArgs};
use elasticps_launch::process::{Cluster, NodeEvent};
use elasticps_runtime::events::Event;

/// Waits for the next `listening` event of a cluster: the address of the node `what`.
pub async fn listening(cluster: &mut Cluster, what: &str) -> crate::Result<String> {
    loop {
        match tokio::time::timeout(Duration::from_secs(20), cluster.next()).await {
            Ok(Some(NodeEvent::Line { event: Event::Listening { addr }, .. })) => return Ok(addr),
            Ok(Some(NodeEvent::Exited { node, status })) => return Err(cluster.failure(node, status).into()),
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => {
                return Err(crate::BenchError::Failed(format!("{what} did not report its address within 20 s")));
            }
        }
    }
}

/// Starts the scheduler of `job` as the node `name`; returns its address.
pub async fn scheduler(
    cluster: &mut Cluster,
    job: &JobArgs,
    net: &NetArgs,
    name: &str,
    env: &[(&str, &str)],
) -> crate::Result<String> {
    let mut args = vec!["scheduler".to_string(), "--listen".into(), "127.0.0.1:0".into()];
    args.extend(job.to_flags());
    args.extend(net.to_flags());
    cluster.spawn(name, &args, env)?;
    listening(cluster, "the scheduler").await
}

/// Starts a server of the scheduler at `scheduler`, listening on `listen`, as the node
/// `name`; returns its node.
pub fn server(
    cluster: &mut Cluster,
    scheduler: &str,
    listen: &str,
    net: &NetArgs,
    name: &str,
    env: &[(&str, &str)],
) -> crate::Result<usize> {
    let mut args = vec!["server".to_string(), "--scheduler".into(), scheduler.into(), "--listen".into(), listen.into()];
    args.extend(net.to_flags());
    Ok(cluster.spawn(name, &args, env)?)
}
