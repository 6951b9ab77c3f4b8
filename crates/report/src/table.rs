//! Plain-text Markdown tables with aligned pipes.
//!
//! Used by the experiment summary (`summary.md`) and meant to be reused by
//! anything else that prints tabular results (benchmarks, comparisons).

/// Renders a GitHub-flavoured Markdown table whose pipes line up when the
/// Markdown is read as plain text.
///
/// * Every column is padded to its widest cell (counted in `char`s).
/// * A column whose non-empty body cells all look numeric (see
///   [`looks_numeric`]) is right-aligned (`---:`); others are left-aligned.
/// * Rows shorter than the header are padded with empty cells; if a row is
///   longer, extra columns with empty headers are added so nothing is lost.
/// * `|` inside a cell is escaped as `\|` and line breaks become spaces, so a
///   cell can never break the table structure.
///
/// ```text
/// | id | sync |  bytes |
/// |---:|:-----|-------:|
/// |  0 | bsp  | 1.0 MB |
/// ```
pub fn markdown_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let ncols = rows.iter().map(Vec::len).chain(std::iter::once(headers.len())).max().unwrap_or(0);
    if ncols == 0 {
        return String::new();
    }

    let header_cells: Vec<String> = (0..ncols).map(|c| escape_cell(headers.get(c).copied().unwrap_or(""))).collect();
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|row| (0..ncols).map(|c| escape_cell(row.get(c).map(String::as_str).unwrap_or(""))).collect())
        .collect();

    let mut widths: Vec<usize> = header_cells.iter().map(|h| width(h)).collect();
    for row in &body {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(width(cell));
        }
    }
    // Empty header and body: keep at least one column of padding so the
    // separator still has a dash.
    for w in &mut widths {
        *w = (*w).max(1);
    }

    let right: Vec<bool> = (0..ncols)
        .map(|c| {
            let mut cells = body.iter().map(|r| r[c].as_str()).filter(|s| !s.is_empty());
            let mut any = false;
            let all = cells.all(|s| {
                any = true;
                looks_numeric(s)
            });
            any && all
        })
        .collect();

    let mut out = String::new();
    push_row(&mut out, &header_cells, &widths, &right);
    out.push('|');
    for (w, r) in widths.iter().zip(&right) {
        if *r {
            out.push_str(&"-".repeat(w + 1));
            out.push(':');
        } else {
            out.push(':');
            out.push_str(&"-".repeat(w + 1));
        }
        out.push('|');
    }
    out.push('\n');
    for row in &body {
        push_row(&mut out, row, &widths, &right);
    }
    out
}

/// `x` with `decimals` decimals, or `-` when it is not a number (a cell of a run that
/// measured nothing).
pub fn fixed(x: f64, decimals: usize) -> String {
    if x.is_finite() { format!("{x:.decimals$}") } else { "-".into() }
}

/// `a / b` as a percentage (`87%`), or `-`.
pub fn percent(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && b > 0.0 { format!("{:.0}%", a / b * 100.0) } else { "-".into() }
}

/// Whether a cell reads as a number, possibly with thousands separators, a
/// sign, a trailing `%` or a short unit suffix (`"12,345.6"`, `"-0.5"`,
/// `"97.3%"`, `"1.50 MiB"`, `"12 ms"`). Used to right-align numeric columns.
pub fn looks_numeric(cell: &str) -> bool {
    let s = cell.trim();
    // Strip an optional unit suffix separated by a single space.
    let s = match s.rsplit_once(' ') {
        Some((num, unit))
            if !unit.is_empty() && unit.len() <= 4 && unit.chars().all(|c| c.is_ascii_alphabetic() || c == '/') =>
        {
            num
        }
        _ => s,
    };
    let s = s.strip_suffix('%').unwrap_or(s);
    let cleaned: String = s.chars().filter(|&c| c != ',' && c != '_').collect();
    !cleaned.is_empty()
        && cleaned.chars().next().is_some_and(|c| c.is_ascii_digit() || c == '-' || c == '+' || c == '.')
        && cleaned.parse::<f64>().is_ok()
}

fn push_row(out: &mut String, cells: &[String], widths: &[usize], right: &[bool]) {
    out.push('|');
    for ((cell, w), r) in cells.iter().zip(widths).zip(right) {
        let pad = " ".repeat(w - width(cell));
        out.push(' ');
        if *r {
            out.push_str(&pad);
            out.push_str(cell);
        } else {
            out.push_str(cell);
            out.push_str(&pad);
        }
        out.push_str(" |");
    }
    out.push('\n');
}

fn escape_cell(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.trim().chars() {
        match c {
            '|' => out.push_str("\\|"),
            '\n' | '\r' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

fn width(s: &str) -> usize {
    s.chars().count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_of_numbers_that_may_be_missing() {
        assert_eq!((fixed(1.256, 2), fixed(f64::NAN, 1)), ("1.26".to_string(), "-".to_string()));
        assert_eq!((percent(3.0, 4.0), percent(1.0, 0.0)), ("75%".to_string(), "-".to_string()));
    }

    fn row(cells: &[&str]) -> Vec<String> {
        cells.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn aligned_pipes_and_numeric_right_alignment() {
        let t =
            markdown_table(&["id", "sync", "bytes"], &[row(&["0", "bsp", "1.50 MiB"]), row(&["12", "async", "800 B"])]);
        let expected = "\
| id | sync  |    bytes |
|---:|:------|---------:|
|  0 | bsp   | 1.50 MiB |
| 12 | async |    800 B |
";
        assert_eq!(t, expected);
        // Every line has its pipes at the same byte offsets.
        let pipes: Vec<Vec<usize>> = t.lines().map(|l| l.match_indices('|').map(|(i, _)| i).collect()).collect();
        assert!(pipes.windows(2).all(|w| w[0] == w[1]));
    }

    #[test]
    fn ragged_rows_and_escaping() {
        let t = markdown_table(&["a", "b"], &[row(&["x|y"]), row(&["1", "2", "3"])]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[2].contains("x\\|y"));
        assert!(lines[3].contains(" 3 |"));
        // Three columns everywhere (the escaped pipe is not a separator).
        for l in &lines {
            assert_eq!(l.replace("\\|", "").matches('|').count(), 4, "{l}");
        }
    }

    #[test]
    fn empty_inputs() {
        assert_eq!(markdown_table(&[], &[]), "");
        let t = markdown_table(&["only"], &[]);
        assert_eq!(t, "| only |\n|:-----|\n");
    }

    #[test]
    fn numeric_detection() {
        for s in ["1", "-0.5", "12,345.6", "97.3%", "1.50 MiB", "12 ms", "3e-4"] {
            assert!(looks_numeric(s), "{s}");
        }
        for s in ["", "bsp", "n/a", "rank 0", "NaN", "inf"] {
            assert!(!looks_numeric(s), "{s}");
        }
    }
}
