//! Addresses for a job that spans hosts: the rendezvous (`--rdzv HOST:PORT` or `slurm`),
//! the address a host's nodes advertise (the interface that routes to the scheduler,
//! `--interface NAME`, or `--advertise`), and the checks that refuse an address nobody
//! else can reach, with what to pass instead.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};

use crate::{LaunchError, Result};

/// The rendezvous port when `--rdzv` names none (torchrun's).
pub const DEFAULT_RDZV_PORT: u16 = 29400;

/// `addr` split into its host (without brackets) and its port, if it names one:
/// `10.0.0.1:80`, `[::1]:80`, `node-3:80`; `10.0.0.1`, `::1` and `node-3` name none.
pub fn split_port(addr: &str) -> (&str, Option<u16>) {
    if addr.parse::<IpAddr>().is_ok() {
        return (addr, None);
    }
    match addr.rsplit_once(':').map(|(h, p)| (h, p.parse::<u16>())) {
        Some((host, Ok(port))) if !host.trim_matches(['[', ']']).is_empty() => {
            (host.trim_matches(['[', ']']), Some(port))
        }
        _ => (addr, None),
    }
}

/// Resolves `addr` (`HOST:PORT`, or `HOST` with `default_port`) to one socket address,
/// IPv4 first.
pub fn resolve(addr: &str, default_port: u16, what: &str) -> Result<SocketAddr> {
    let (host, port) = split_port(addr);
    let all: Vec<SocketAddr> = (host, port.unwrap_or(default_port))
        .to_socket_addrs()
        .map_err(|e| LaunchError::Flags(format!("{what} {addr}: cannot resolve it ({e})")))?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| LaunchError::Flags(format!("{what} {addr}: it resolves to no address")))
}

/// True if `ip` is an address of this host (a socket can be bound to it).
pub fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// The source address this host uses to reach `to` (the interface that routes there).
pub fn route_to(to: SocketAddr) -> Result<IpAddr> {
    let any: SocketAddr = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }
        .parse()
        .map_err(|_| LaunchError::Flags("bad address".into()))?;
    let socket = UdpSocket::bind(any).map_err(|e| LaunchError::io("binding a socket to find the route", e))?;
    socket
        .connect(to)
        .map_err(|e| LaunchError::Flags(format!("no route from this host to the scheduler at {to}: {e}")))?;
    Ok(socket.local_addr().map_err(|e| LaunchError::io("reading the routed address", e))?.ip())
}

/// The IPv4 address of interface `name` (or its first address of any family).
pub fn interface_ip(name: &str) -> Result<IpAddr> {
    let mut found: Vec<(String, IpAddr)> = Vec::new();
    // SAFETY: getifaddrs fills a list that freeifaddrs frees; we read it in between, and
    // only the sockaddr of the family each entry says it has.
    unsafe {
        let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut list) != 0 {
            return Err(LaunchError::io("listing the interfaces", std::io::Error::last_os_error()));
        }
        let mut at = list;
        while !at.is_null() {
            let entry = &*at;
            at = entry.ifa_next;
            if entry.ifa_addr.is_null() || entry.ifa_name.is_null() {
                continue;
            }
            let ifname = std::ffi::CStr::from_ptr(entry.ifa_name).to_string_lossy().into_owned();
            let ip = match i32::from((*entry.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(entry.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes())
                }
                libc::AF_INET6 => {
                    let sin6 = &*(entry.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::from(sin6.sin6_addr.s6_addr)
                }
                _ => continue,
            };
            found.push((ifname, ip));
        }
        libc::freeifaddrs(list);
    }
    let mine: Vec<IpAddr> = found.iter().filter(|(n, _)| n == name).map(|(_, ip)| *ip).collect();
    if let Some(ip) = mine.iter().find(|ip| ip.is_ipv4()).or(mine.first()) {
        return Ok(*ip);
    }
    let mut names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
    names.dedup();
    Err(LaunchError::Flags(format!(
        "--interface {name}: no such interface with an address (this host has: {})",
        names.join(", ")
    )))
}

/// The address this host's nodes advertise to the scheduler at `scheduler`: `advertise`
/// if given, else the address of `interface`, else the one that routes to the scheduler.
/// An unspecified address, or a loopback one to a scheduler on another host, is refused
/// with what to pass instead.
pub fn advertise_ip(scheduler: SocketAddr, advertise: Option<&str>, interface: Option<&str>) -> Result<IpAddr> {
    let ip = match (advertise, interface) {
        (Some(a), _) => {
            let ip = resolve(a, 0, "--advertise")?.ip();
            if !is_local(ip) {
                return Err(LaunchError::Flags(format!(
                    "--advertise {a}: {ip} is not an address of this host (its servers listen on it): pass one of \
                     this host's addresses, or --interface NAME"
                )));
            }
            ip
        }
        (None, Some(name)) => interface_ip(name)?,
        (None, None) => route_to(scheduler)?,
    };
    check_advertised(ip, scheduler)?;
    Ok(ip)
}

/// Refuses to advertise `ip` to the scheduler at `scheduler` if nobody there could dial it.
pub fn check_advertised(ip: IpAddr, scheduler: SocketAddr) -> Result<()> {
    if ip.is_unspecified() {
        return Err(LaunchError::Flags(format!(
            "this host would advertise the unspecified address {ip}, which nobody can dial: pass --advertise with \
             this host's address, or --interface NAME"
        )));
    }
    if ip.is_loopback() && !scheduler.ip().is_loopback() && !is_local(scheduler.ip()) {
        return Err(LaunchError::Flags(format!(
            "this host would advertise the loopback address {ip} to the scheduler at {scheduler}, on another host, \
             which cannot dial it: pass --advertise with an address of this host that {} can reach, or --interface \
             NAME",
            scheduler.ip()
        )));
    }
    Ok(())
}

/// `--rdzv slurm`: the rendezvous host is the first of `SLURM_JOB_NODELIST`, the number of
/// hosts `SLURM_NNODES`. Returns (host name, hosts).
pub fn slurm_rendezvous(env: impl Fn(&str) -> Option<String>) -> Result<(String, u32)> {
    let need = |k: &str| {
        env(k).filter(|v| !v.is_empty()).ok_or_else(|| {
            LaunchError::Flags(format!(
                "--rdzv slurm: {k} is not set (run it under srun, inside an sbatch or salloc allocation)"
            ))
        })
    };
    let list = need("SLURM_JOB_NODELIST").or_else(|_| need("SLURM_NODELIST"))?;
    let first = first_host(&list)
        .ok_or_else(|| LaunchError::Flags(format!("--rdzv slurm: cannot read SLURM_JOB_NODELIST={list:?}")))?;
    let nnodes = need("SLURM_NNODES")?
        .parse::<u32>()
        .map_err(|_| LaunchError::Flags("--rdzv slurm: SLURM_NNODES is not a number".into()))?;
    Ok((first, nnodes))
}

/// The first host of a Slurm host list: `n[1-3,7],m2` -> `n1`, `gpu[007-009]` ->
/// `gpu007`, `a,b` -> `a`.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inner = &list[end + 1..list[end..].find(']')? + end];
        let first = inner.split([',', '-']).next()?.trim();
        (!first.is_empty()).then(|| format!("{prefix}{first}"))
    } else {
        (!prefix.is_empty()).then(|| prefix.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_host_of_a_slurm_list() {
        assert_eq!(first_host("n[1-2]").as_deref(), Some("n1"));
        assert_eq!(first_host("gpu[007-009,011],cpu3").as_deref(), Some("gpu007"));
        assert_eq!(first_host("alpha,beta").as_deref(), Some("alpha"));
        assert_eq!(first_host("solo").as_deref(), Some("solo"));
        assert_eq!(first_host("").as_deref(), None);
        assert_eq!(first_host("n[").as_deref(), None);
    }

    #[test]
    fn slurm_says_which_variable_is_missing() {
        let env = |k: &str| match k {
            "SLURM_JOB_NODELIST" => Some("n[1-2]".to_string()),
            "SLURM_NNODES" => Some("2".to_string()),
            _ => None,
        };
        assert_eq!(slurm_rendezvous(env).unwrap(), ("n1".to_string(), 2));
        let e = slurm_rendezvous(|_| None).unwrap_err().to_string();
        assert!(e.contains("SLURM_NODELIST") && e.contains("srun"), "{e}");
    }

    #[test]
    fn loopback_and_unspecified_addresses_are_refused_with_what_to_pass() {
        let far: SocketAddr = "203.0.113.7:29400".parse().unwrap();
        let e = check_advertised("127.0.0.1".parse().unwrap(), far).unwrap_err().to_string();
        assert!(e.contains("loopback") && e.contains("--advertise") && e.contains("--interface"), "{e}");
        let e = check_advertised("0.0.0.0".parse().unwrap(), far).unwrap_err().to_string();
        assert!(e.contains("unspecified"), "{e}");
        // On one host, loopback is fine.
        check_advertised("127.0.0.1".parse().unwrap(), "127.0.0.1:29400".parse().unwrap()).unwrap();
        assert_eq!(resolve("127.0.0.1", 29400, "--rdzv").unwrap().port(), 29400);
        assert_eq!(resolve("127.0.0.1:7", 29400, "--rdzv").unwrap().port(), 7);
        assert_eq!(resolve("[::1]:7", 29400, "--rdzv").unwrap().port(), 7);
        assert_eq!(split_port("10.0.0.1"), ("10.0.0.1", None));
        assert_eq!(split_port("::1"), ("::1", None));
        assert_eq!(split_port("[::1]:80"), ("::1", Some(80)));
        assert_eq!(split_port("node-3:80"), ("node-3", Some(80)));
        assert_eq!(split_port("node-3"), ("node-3", None));
        assert!(interface_ip("lo").unwrap().is_loopback());
        assert!(interface_ip("no-such-if0").unwrap_err().to_string().contains("lo"));
    }
}
