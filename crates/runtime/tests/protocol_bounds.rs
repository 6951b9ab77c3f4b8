//! docs/PROTOCOL.md §8's table "Bounds on what a peer can make a node hold" read against
//! the constants the nodes apply (issue 35): every row names its constants, and its
//! default is theirs; every bound constant has a row. The runtime's tests see the
//! constants of every crate that applies one (wire, node, runtime).

use std::collections::BTreeMap;

use elasticps_node::link::{MAX_IN_FLIGHT, MAX_QUEUED};
use elasticps_node::scheduler::{MAX_PENDING_SETS_PER_WORKER, MAX_UNREGISTERED, REGISTER_WITHIN_US};
use elasticps_node::server::export::{EXPORT_PAGE_BYTES, EXPORT_PAGE_ROWS};
use elasticps_node::server::{MAX_CLOCK_LEAD, MAX_HELD_PER_CONN, MAX_HELD_PER_SERVER};
use elasticps_node::throttle::{LOGGED_PER_WINDOW, WINDOW_US};
use elasticps_runtime::accept::{MAX_CONNECTIONS, MAX_HANDSHAKES};
use elasticps_runtime::conn::{PRE_HELLO_MAX_PAYLOAD, UNREGISTERED_MAX_PAYLOAD};
use elasticps_runtime::partial::MAX_PARTIAL_BYTES;
use elasticps_wire::DEFAULT_MAX_PAYLOAD;

/// `1048576` as `1,048,576`.
fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A size in bytes as the document writes it: `64 KiB`, `1,024 MiB`.
fn bytes(n: u64) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", count(n >> 20))
    } else if n.is_multiple_of(1024) {
        format!("{} KiB", count(n >> 10))
    } else {
        count(n)
    }
}

/// Every bound constant, by the name the table gives it, and its default as the table
/// writes it.
fn constants() -> BTreeMap<&'static str, String> {
    BTreeMap::from([
        ("DEFAULT_MAX_PAYLOAD", bytes(u64::from(DEFAULT_MAX_PAYLOAD))),
        ("MAX_HANDSHAKES", count(MAX_HANDSHAKES as u64)),
        ("MAX_CONNECTIONS", count(MAX_CONNECTIONS as u64)),
        ("MAX_CLOCK_LEAD", format!("{} clocks", count(u64::from(MAX_CLOCK_LEAD)))),
        ("MAX_HELD_PER_CONN", count(MAX_HELD_PER_CONN as u64)),
        ("MAX_HELD_PER_SERVER", count(MAX_HELD_PER_SERVER as u64)),
        ("REGISTER_WITHIN_US", format!("{} s", REGISTER_WITHIN_US / 1_000_000)),
        ("MAX_UNREGISTERED", count(MAX_UNREGISTERED as u64)),
        ("PRE_HELLO_MAX_PAYLOAD", bytes(u64::from(PRE_HELLO_MAX_PAYLOAD))),
        ("UNREGISTERED_MAX_PAYLOAD", bytes(u64::from(UNREGISTERED_MAX_PAYLOAD))),
        ("MAX_PARTIAL_BYTES", bytes(MAX_PARTIAL_BYTES)),
        ("MAX_PENDING_SETS_PER_WORKER", count(MAX_PENDING_SETS_PER_WORKER as u64)),
        ("MAX_QUEUED", count(MAX_QUEUED as u64)),
        ("MAX_IN_FLIGHT", count(MAX_IN_FLIGHT as u64)),
        ("metrics::MAX_CONNECTIONS", count(elasticps_runtime::metrics::MAX_CONNECTIONS as u64)),
        ("metrics::MAX_REQUEST_BYTES", bytes(elasticps_runtime::metrics::MAX_REQUEST_BYTES as u64)),
        ("EXPORT_PAGE_ROWS", count(EXPORT_PAGE_ROWS as u64)),
        ("EXPORT_PAGE_BYTES", bytes(EXPORT_PAGE_BYTES as u64)),
        ("LOGGED_PER_WINDOW", format!("{} per {} s", count(u64::from(LOGGED_PER_WINDOW)), WINDOW_US / 1_000_000)),
    ])
}

/// The rows of the table: (bound cell, default cell).
fn rows() -> Vec<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/PROTOCOL.md");
    let doc = std::fs::read_to_string(path).expect("docs/PROTOCOL.md");
    let start =
        doc.find("**Bounds on what a peer can make a node hold.**").expect("docs/PROTOCOL.md §8 has its bounds table");
    let mut lines = doc[start..].lines().skip_while(|l| !l.starts_with("| bound | default |"));
    assert!(lines.next().is_some(), "the bounds table is headed `| bound | default | what happens beyond it |`");
    lines.next(); // the rule
    lines
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            assert_eq!(cells.len(), 3, "a row of 3 cells: {l}");
            (cells[0].to_string(), cells[1].to_string())
        })
        .collect()
}

/// The constants a bound cell names: its backticked words in capitals (`MAX_QUEUED`,
/// `metrics::MAX_CONNECTIONS`).
fn named(cell: &str) -> Vec<&str> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| {
            let last = w.rsplit("::").next().unwrap_or(w);
            last.len() > 2 && last.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .collect()
}

#[test]
fn every_bound_of_the_table_is_the_constant_it_names() {
    let constants = constants();
    let mut seen = Vec::new();
    for (bound, default) in rows() {
        let names = named(&bound);
        if names.is_empty() {
            // A bound the job itself sets (a host agent's slots, a host group's size) has
            // no constant.
            assert!(
                bound.contains("host agent") || bound.contains("host group"),
                "the row `{bound}` names no constant"
            );
            continue;
        }
        for name in names {
            let value = constants.get(name).unwrap_or_else(|| panic!("`{bound}` names `{name}`, which is no bound"));
            assert!(
                default.contains(value.as_str()),
                "`{bound}`: the document says {default:?}, but {name} is {value}"
            );
            seen.push(name.to_string());
        }
    }
    let missing: Vec<&&str> = constants.keys().filter(|c| !seen.iter().any(|s| s == *c)).collect();
    assert!(missing.is_empty(), "bound constants the table does not list: {missing:?}");
}

#[test]
fn numbers_are_written_as_the_document_writes_them() {
    assert_eq!((count(7), count(1_024), count(1_048_576)), ("7".into(), "1,024".into(), "1,048,576".into()));
    assert_eq!(
        (bytes(64 << 10), bytes(1024 << 20), bytes(8 * 1024)),
        ("64 KiB".into(), "1,024 MiB".into(), "8 KiB".into())
    );
    assert_eq!(
        named("held pulls (`MAX_HELD_PER_CONN`, `--max-x`, `metrics::MAX_CONNECTIONS`)"),
        ["MAX_HELD_PER_CONN", "metrics::MAX_CONNECTIONS"]
    );
}
