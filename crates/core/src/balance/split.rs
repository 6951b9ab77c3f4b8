//! Rule 2b: a row block heavier than a fair share of the load cannot be balanced (the
//! server holding it carries more than its share wherever it goes), so it is split at the
//! row its server reports ([`Decision::Split`]); the halves then move as any block.
//! Check: the block split is live, owned by a server considered, and heavier than the
//! fair share.

use std::collections::BTreeMap;

use super::Decision;
use crate::model::BlockId;
use crate::placement::{Placement, ServerId};

/// The heaviest block of `splittable` (block -> the row to split it at) owned by one of
/// `servers` whose size is above `(1 + threshold)` times the fair share, `total bytes /
/// servers`, as a [`Decision::Split`]; ties to the lowest id.
pub fn heavy_row_block(
    placement: &Placement,
    sizes: &[u64],
    servers: &[ServerId],
    splittable: &BTreeMap<BlockId, u64>,
    threshold: f64,
) -> Option<Decision> {
    if servers.len() < 2 || splittable.is_empty() {
        return None;
    }
    let owned = |b: BlockId| placement.owner(b).is_some_and(|o| servers.contains(&o));
    let size = |b: BlockId| sizes.get(b as usize).copied().unwrap_or(0);
    let total: u64 = (0..placement.owners.len() as BlockId).filter(|b| owned(*b)).map(size).sum();
    let fair = total as f64 / servers.len() as f64;
    let (block, at) = splittable
        .iter()
        .filter(|(b, _)| owned(**b) && size(**b) as f64 > (1.0 + threshold) * fair)
        .max_by_key(|(b, _)| (size(**b), std::cmp::Reverse(**b)))
        .map(|(b, at)| (*b, *at))?;
    debug_assert!(owned(block) && size(block) as f64 > fair, "split of block {block}: not heavy or not owned");
    let why = format!(
        "row block {block} carries {:.0}% of the load, more than a fair share of {} servers: split at row {at}",
        100.0 * size(block) as f64 / total.max(1) as f64,
        servers.len()
    );
    Some(Decision::Split { block, at, why })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_row_block_heavier_than_a_fair_share_is_split_the_heaviest_first() {
        // Blocks 0..4 on servers 0, 1, 0, 1; sizes 10, 10, 60, 20 (fair share 50).
        let p = Placement::new(1, vec![0, 1, 0, 1]);
        let sizes = [10, 10, 60, 20];
        let splittable = BTreeMap::from([(2, 7), (3, 9)]);
        match heavy_row_block(&p, &sizes, &[0, 1], &splittable, 0.1) {
            Some(Decision::Split { block: 2, at: 7, why }) => assert!(why.contains("60%"), "{why}"),
            other => panic!("{other:?}"),
        }
        // Within the threshold: 60 is not above 1.2 x 50.
        assert_eq!(heavy_row_block(&p, &sizes, &[0, 1], &splittable, 0.2), None);
        // A block without a split point, or on a server not considered, stays whole.
        assert_eq!(heavy_row_block(&p, &sizes, &[0, 1], &BTreeMap::from([(3, 9)]), 0.1), None);
        assert_eq!(heavy_row_block(&p, &sizes, &[1], &splittable, 0.1), None);
    }
}
