//! Integration tests of elasticps-node, one module per subject (the whole jobs on the
//! simulated network are elasticps-harness's tests).

mod authz;

/// The authorization table of docs/PROTOCOL.md §7.1 is the one the nodes enforce,
/// `elasticps_node::authz::TABLE`: same rows, same classes.
mod authz_table_doc {
    use std::collections::BTreeSet;

    use elasticps_node::authz::{Class, TABLE};

    /// One row: (message, receiver, classes).
    type Row = (String, String, BTreeSet<Class>);

    fn section() -> String {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/PROTOCOL.md");
        let doc = std::fs::read_to_string(path).expect("docs/PROTOCOL.md");
        let start =
            doc.find("\n### 7.1 Who may send what\n").expect("docs/PROTOCOL.md has `### 7.1 Who may send what`");
        let rest = &doc[start + 1..];
        let end = rest[4..].find("\n#").map_or(rest.len(), |e| e + 4);
        rest[..end].to_string()
    }

    /// The cells of a Markdown table row, without backticks.
    fn cells(line: &str) -> Vec<String> {
        let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
        inner.split('|').map(|c| c.trim().replace('`', "")).collect()
    }

    /// The rows of the table whose header is `| message | receiver | classes |`.
    fn doc_rows() -> Vec<Row> {
        let section = section();
        let mut lines = section.lines().skip_while(|l| cells(l) != ["message", "receiver", "classes"]);
        assert!(lines.next().is_some(), "§7.1 has no table headed `| message | receiver | classes |`");
        let rule = lines.next().unwrap_or_default();
        assert!(rule.trim_start().starts_with("|-") || rule.trim_start().starts_with("| -"), "not a table: {rule}");
        let mut rows = Vec::new();
        for line in lines.take_while(|l| l.trim_start().starts_with('|')) {
            let c = cells(line);
            assert_eq!(c.len(), 3, "§7.1 row `{line}` does not have 3 cells");
            let mut classes = BTreeSet::new();
            for name in c[2].split(',').map(str::trim) {
                let class = Class::from_name(name).unwrap_or_else(|| {
                    panic!("§7.1 row `{line}`: `{name}` is no class (anon, anon-w, worker, server, agent)")
                });
                assert!(classes.insert(class), "§7.1 row `{line}` names `{name}` twice");
            }
            rows.push((c[0].clone(), c[1].clone(), classes));
        }
        rows
    }

    fn code_rows() -> Vec<Row> {
        TABLE.iter().map(|(m, r, cs)| (m.to_string(), r.name().to_string(), cs.iter().copied().collect())).collect()
    }

    fn show(rows: &[&Row]) -> String {
        rows.iter()
            .map(|(m, r, cs)| {
                let names: Vec<&str> = cs.iter().map(|c| c.name()).collect();
                format!("\n  | `{m}` | {r} | {} |", names.join(", "))
            })
            .collect()
    }

    #[test]
    fn the_documented_table_is_the_enforced_one() {
        let (doc, code) = (doc_rows(), code_rows());
        let missing: Vec<&Row> = code.iter().filter(|r| !doc.contains(r)).collect();
        let extra: Vec<&Row> = doc.iter().filter(|r| !code.contains(r)).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "docs/PROTOCOL.md §7.1 differs from elasticps_node::authz::TABLE.\nrows of TABLE not in the document:{}\nrows of the document not in TABLE:{}",
            show(&missing),
            show(&extra)
        );
        let pairs: BTreeSet<(&str, &str)> = doc.iter().map(|(m, r, _)| (m.as_str(), r.as_str())).collect();
        assert_eq!(pairs.len(), doc.len(), "§7.1 lists a message for one receiver twice");
        assert_eq!(doc.len(), TABLE.len());
    }

    #[test]
    fn the_document_defines_every_class() {
        let section = section();
        for class in Class::ALL {
            let row = format!("| `{}` |", class.name());
            assert!(
                section.contains(&row),
                "§7.1 does not define the class `{}` (a row starting `{row}`)",
                class.name()
            );
        }
    }
}
