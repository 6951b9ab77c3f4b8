//! Row requests of embedding tables: the ids a caller gives split by row-range block, each
//! block's `PullRows` or `PushRows` payload built once per round, and the rows of each
//! `PullRowsReply` put back where the caller asked for them (every position of an id
//! asked twice). The round loop (`round.rs`) sends and reads them as it does tensors.

use std::collections::HashMap;

use elasticps_core::model::{BlockSpec, Partition};
use elasticps_core::rows::key_position;
use elasticps_wire::PUSH_ROWS_PREFIX;

use crate::error::{Result, RuntimeError};

/// A row round's requests, one payload per block of the table that gets one.
#[derive(Debug, Default)]
pub(super) struct RowPayloads {
    /// Block id -> the payload: a pull's unique ids (u64 LE), or a push's count, dim, ids
    /// and gradient rows; empty for a push without a gradient (sent as an empty `Push`).
    pub(super) by_block: HashMap<u32, Vec<u8>>,
}

/// Where the rows of a row pull's replies go.
#[derive(Debug)]
pub(super) struct RowSink<'a> {
    dim: usize,
    /// Positions of the caller's ids, sorted by id (stable).
    order: Vec<u32>,
    /// Block id -> for each unique id of the block's payload, in order, its run of
    /// positions in `order`.
    runs: HashMap<u32, Vec<(u32, u32)>>,
    out: &'a mut [f32],
}

impl RowSink<'_> {
    /// Values a reply of block `block` must carry, if the round pulls from it.
    pub(super) fn expected_len(&self, block: u32) -> Option<usize> {
        self.runs.get(&block).map(|r| r.len() * self.dim)
    }

    /// Copies the rows of block `block`'s reply (`values`, one row per unique id asked of
    /// it, in order) to every position that asked for each.
    pub(super) fn scatter(&mut self, block: u32, values: &[f32]) {
        let Some(runs) = self.runs.get(&block) else { return };
        let dim = self.dim;
        for (row, &(a, b)) in values.chunks_exact(dim).zip(runs) {
            for &pos in &self.order[a as usize..b as usize] {
                let at = pos as usize * dim;
                self.out[at..at + dim].copy_from_slice(row);
            }
        }
    }
}

/// The table `table` of `partition`: (rows, dim), or the error naming what is wrong.
fn table_shape(partition: &Partition, table: u32) -> Result<(u64, usize)> {
    partition
        .tables
        .get(table as usize)
        .map(|t| (t.rows, t.dim as usize))
        .ok_or_else(|| RuntimeError::Usage(format!("table {table}: the model has {} tables", partition.tables.len())))
}

/// Where table `table` places a row or key: its [`key_position`] in a hashed table, the row
/// itself otherwise.
fn placer(partition: &Partition, table: u32) -> fn(u64) -> u64 {
    match partition.tables.get(table as usize) {
        Some(t) if t.is_hashed() => key_position,
        _ => std::convert::identity,
    }
}

/// Checks the ids against the table's rows and `values` (the rows out, or the gradients
/// in) against `ids.len() x dim`; returns the positions in `ids` sorted by where the
/// table places them (then by id), and the dim.
fn check(partition: &Partition, what: &str, table: u32, ids: &[u64], values: usize) -> Result<(Vec<u32>, usize)> {
    let (rows, dim) = table_shape(partition, table)?;
    let name = &partition.tables[table as usize].name;
    let place = placer(partition, table);
    if let Some(bad) = ids.iter().find(|id| place(**id) >= rows) {
        return Err(RuntimeError::Usage(format!(
            "{what}: row id {bad} is out of range: table {name:?} has {rows} rows"
        )));
    }
    if values != ids.len() * dim {
        return Err(RuntimeError::Usage(format!(
            "{what}: {} ids of table {name:?} ({dim} values per row) need {} values, {values} were given",
            ids.len(),
            ids.len() * dim
        )));
    }
    let n = u32::try_from(ids.len()).map_err(|_| RuntimeError::Usage(format!("{what}: more than 2^32 ids")))?;
    let mut order: Vec<u32> = (0..n).collect();
    if !partition.tables[table as usize].is_hashed() {
        order.sort_by_key(|&i| ids[i as usize]);
    } else {
        let keys: Vec<(u64, u64)> = ids.iter().map(|id| (place(*id), *id)).collect();
        order.sort_by_key(|&i| keys[i as usize]);
    }
    Ok((order, dim))
}

/// The blocks of `table` with the range of `order` (sorted as [`check`] sorts) whose ids
/// each holds.
fn split<'p>(
    partition: &'p Partition,
    table: u32,
    ids: &'p [u64],
    order: &'p [u32],
) -> impl Iterator<Item = (&'p BlockSpec, usize, usize)> + 'p {
    let place = placer(partition, table);
    partition.table_blocks(table).into_iter().filter_map(move |b| {
        let (start, end, _) = b.row_range()?;
        let a = order.partition_point(|&i| place(ids[i as usize]) < start);
        let z = order.partition_point(|&i| place(ids[i as usize]) < end);
        Some((b, a, z))
    })
}

/// A row pull of `ids` of table `table` into `out` (`ids.len() x dim`): the payload of
/// each block holding some (its unique ids, in id order), and where their rows go.
pub(super) fn pull_plan<'a>(
    partition: &Partition,
    table: u32,
    ids: &[u64],
    out: &'a mut [f32],
) -> Result<(RowPayloads, RowSink<'a>)> {
    let (order, dim) = check(partition, "pull_rows", table, ids, out.len())?;
    let mut payloads = RowPayloads::default();
    let mut runs = HashMap::new();
    for (b, a, z) in split(partition, table, ids, &order) {
        if a == z {
            continue;
        }
        let mut bytes = Vec::new();
        let mut block_runs = Vec::new();
        let mut k = a;
        while k < z {
            let id = ids[order[k] as usize];
            let end = k + order[k..z].iter().take_while(|&&i| ids[i as usize] == id).count();
            bytes.extend_from_slice(&id.to_le_bytes());
            block_runs.push((k as u32, end as u32));
            k = end;
        }
        payloads.by_block.insert(b.id, bytes);
        runs.insert(b.id, block_runs);
    }
    Ok((payloads, RowSink { dim, order, runs, out }))
}

/// A row push of `grads` (`ids.len() x dim`) for `ids` of table `table`: one payload per
/// block of the table, with the ids in its range and their gradient rows (a row named
/// twice is sent twice; the server sums), or none (an empty push, which still counts the
/// clock there).
pub(super) fn push_plan(partition: &Partition, table: u32, ids: &[u64], grads: &[f32]) -> Result<RowPayloads> {
    let (order, dim) = check(partition, "push_rows", table, ids, grads.len())?;
    let mut payloads = RowPayloads::default();
    for (b, a, z) in split(partition, table, ids, &order) {
        let count = (z - a) as u32;
        let mut bytes = Vec::with_capacity(PUSH_ROWS_PREFIX + (z - a) * (8 + dim * 4));
        bytes.extend_from_slice(&count.to_le_bytes());
        bytes.extend_from_slice(&(dim as u32).to_le_bytes());
        for &i in &order[a..z] {
            bytes.extend_from_slice(&ids[i as usize].to_le_bytes());
        }
        // A row at a time (little-endian is the wire's and every target's order).
        for &i in &order[a..z] {
            let at = i as usize * dim;
            bytes.extend_from_slice(bytemuck::cast_slice(&grads[at..at + dim]));
        }
        payloads.by_block.insert(b.id, bytes);
    }
    Ok(payloads)
}

/// The push of a table that got no gradient this clock (a torch parameter whose `grad`
/// is None): an empty payload for every block of the table, which goes out as an empty
/// `Push` (docs/PROTOCOL.md §4): the clock counts and no optimizer step is taken, where an
/// empty `PushRows` is a step that touched no row of the block.
pub(super) fn no_gradient_plan(partition: &Partition, table: u32) -> Result<RowPayloads> {
    if partition.tables.get(table as usize).is_none() {
        return Err(RuntimeError::Usage(format!("push_rows: the model has no table {table}")));
    }
    let by_block = partition.table_blocks(table).into_iter().map(|b| (b.id, Vec::new())).collect();
    Ok(RowPayloads { by_block })
}

#[cfg(test)]
mod tests {
    use elasticps_core::model::{Init, TableSpec, TensorSpec};

    use super::*;

    /// One tensor (block 0), then a table of 10 rows x 2 cut into blocks of 2 rows (1..=5).
    fn partition() -> Partition {
        let t = vec![TensorSpec { name: "w".into(), shape: vec![4], init: Init::Zeros }];
        Partition::with_tables(t, vec![TableSpec::new("emb", 10, 2)], 16).unwrap()
    }

    fn ids_of(bytes: &[u8]) -> Vec<u64> {
        bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
    }

    #[test]
    fn a_pull_asks_each_block_its_unique_ids_and_puts_every_row_back_in_the_order_asked() {
        let p = partition();
        let ids = [9, 0, 5, 9, 4, 1];
        let mut out = vec![0.0; ids.len() * 2];
        let (payloads, mut sink) = pull_plan(&p, 0, &ids, &mut out).unwrap();
        let mut asked: Vec<(u32, Vec<u64>)> = payloads.by_block.iter().map(|(b, v)| (*b, ids_of(v))).collect();
        asked.sort();
        // Rows 0, 1 in block 1; 4, 5 in block 3; 9 (asked twice, sent once) in block 5.
        assert_eq!(asked, [(1, vec![0, 1]), (3, vec![4, 5]), (5, vec![9])]);
        assert_eq!(sink.expected_len(5), Some(2));
        assert_eq!(sink.expected_len(2), None);
        // The server answers each row as (id, id + 0.5).
        for (b, asked) in &asked {
            let values: Vec<f32> = asked.iter().flat_map(|&id| [id as f32, id as f32 + 0.5]).collect();
            sink.scatter(*b, &values);
        }
        let want: Vec<f32> = ids.iter().flat_map(|&id| [id as f32, id as f32 + 0.5]).collect();
        assert_eq!(out, want);
    }

    #[test]
    fn a_push_goes_to_every_block_with_the_rows_of_its_range() {
        let p = partition();
        let ids = [9, 0, 9];
        let grads = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let payloads = push_plan(&p, 0, &ids, &grads).unwrap();
        let mut blocks: Vec<u32> = payloads.by_block.keys().copied().collect();
        blocks.sort_unstable();
        assert_eq!(blocks, [1, 2, 3, 4, 5]);
        // An untouched block: count 0, dim 2, nothing else.
        assert_eq!(payloads.by_block[&2], [0, 0, 0, 0, 2, 0, 0, 0]);
        let b5 = &payloads.by_block[&5];
        assert_eq!(b5[..8], [2, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(ids_of(&b5[8..24]), [9, 9]);
        let g: Vec<f32> = b5[24..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(g, [1.0, 2.0, 5.0, 6.0]);
    }

    #[test]
    fn bad_ids_and_shapes_are_usage_errors_naming_the_table() {
        let p = partition();
        let e = push_plan(&p, 0, &[10], &[0.0; 2]).unwrap_err().to_string();
        assert!(e.contains("row id 10 is out of range") && e.contains("\"emb\" has 10 rows"), "{e}");
        let e = push_plan(&p, 0, &[1], &[0.0; 3]).unwrap_err().to_string();
        assert!(e.contains("need 2 values, 3 were given"), "{e}");
        let mut out = [0.0; 2];
        let e = pull_plan(&p, 1, &[1], &mut out).unwrap_err().to_string();
        assert!(e.contains("table 1: the model has 1 tables"), "{e}");
    }
}
