//! Which server owns which block. A placement carries an epoch that increases with
//! every change; workers cache it and a server answers `Moved` for a block it does
//! not own.
//!
//! Initial policies, to compare against each other: `range` (ps-lite: contiguous runs
//! of blocks), `hash` (BytePS: djb2 of the tensor name and block index), `roundrobin`
//! (TensorFlow: tensor by tensor in turn), `bestfit` (largest block first onto the
//! least-loaded server: PSLD's starting point), `skewed:IDX` (most of the model on
//! server IDX: PSLD's skewed-placement experiment, a load imbalance to repair).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::CoreError;
use crate::model::{BlockId, Partition};

/// Identifier of a server, assigned by the scheduler from 0.
pub type ServerId = u32;

/// The initial placement policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PlacementKind {
    /// Contiguous runs of about equal numbers of blocks (ps-lite key ranges).
    Range,
    /// djb2 hash of tensor name and block index, modulo the server count.
    Hash,
    /// Tensor by tensor, in turn.
    RoundRobin,
    /// Largest block first onto the server with the fewest bytes.
    BestFit,
    /// Most of the model on one server: largest blocks first onto it until it holds at
    /// least [`SKEWED_SHARE`] of the bytes, the rest best-fit over the other servers.
    Skewed(ServerId),
}

/// The owner of a retired block ([`crate::model::BlockSpec::is_retired`]): no server.
pub const RETIRED: ServerId = ServerId::MAX;

/// The share of the model's bytes `skewed:IDX` puts on server IDX (at least).
pub const SKEWED_SHARE: f64 = 0.7;

impl fmt::Display for PlacementKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PlacementKind::Range => "range",
            PlacementKind::Hash => "hash",
            PlacementKind::RoundRobin => "roundrobin",
            PlacementKind::BestFit => "bestfit",
            PlacementKind::Skewed(idx) => return write!(f, "skewed:{idx}"),
        })
    }
}

impl FromStr for PlacementKind {
    type Err = CoreError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| CoreError::Parse { what: "placement", input: input.to_string(), why: why.into() };
        match input.trim().to_ascii_lowercase().as_str() {
            "range" => Ok(PlacementKind::Range),
            "hash" => Ok(PlacementKind::Hash),
            "roundrobin" | "round-robin" => Ok(PlacementKind::RoundRobin),
            "bestfit" | "best-fit" => Ok(PlacementKind::BestFit),
            s => match s.split_once(':') {
                Some(("skewed", idx)) => idx
                    .trim()
                    .parse()
                    .map(PlacementKind::Skewed)
                    .map_err(|_| bad("expected skewed:IDX with IDX a server index, e.g. skewed:0")),
                _ => Err(bad("expected range, hash, roundrobin, bestfit or skewed:IDX")),
            },
        }
    }
}

/// Block -> owner map with an epoch, and each block's backup copies (`--replicas`).
///
/// The owner of a block is its primary: workers send it their requests, and it forwards
/// every push to the block's backups before it acknowledges the push. When the primary is
/// lost, the first backup becomes the owner ([`Placement::fail_server`]). The invariant
/// ([`Placement::check_copies`]): no two copies of a block on one server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Increases with every change of an owner.
    pub epoch: u64,
    /// `owners[block]` is the server that owns the block (its primary).
    pub owners: Vec<ServerId>,
    /// `backups[block]`: the servers holding a backup copy of the block, oldest first (the
    /// next to be promoted). Empty (no entry per block) for a job without replicas.
    pub backups: Vec<Vec<ServerId>>,
}

impl Placement {
    /// The placement `owners` at `epoch`, with no backups.
    pub fn new(epoch: u64, owners: Vec<ServerId>) -> Self {
        Self { epoch, owners, backups: Vec::new() }
    }

    /// Gives every block `replicas - 1` backups: the servers after its owner in id order,
    /// modulo `servers` (the next servers on the ring, as the OSDI'14 parameter server
    /// replicates a key range). Refuses more copies than servers.
    pub fn with_replicas(mut self, replicas: u32, servers: u32) -> Result<Self, CoreError> {
        if replicas == 0 || replicas > servers {
            return Err(CoreError::InvalidModel(format!(
                "--replicas {replicas} needs at least {replicas} servers (and 1 copy at least); the job has {servers}"
            )));
        }
        self.backups = if replicas == 1 {
            Vec::new()
        } else {
            self.owners.iter().map(|o| (1..replicas).map(|k| (o + k) % servers).collect()).collect()
        };
        debug_assert_eq!(self.check_copies(), Ok(()));
        Ok(self)
    }

    /// The backups of `block` (none without replicas).
    pub fn backups_of(&self, block: BlockId) -> &[ServerId] {
        self.backups.get(block as usize).map_or(&[], Vec::as_slice)
    }

    /// True if `server` holds a copy of `block`: its primary or a backup.
    pub fn holds_copy(&self, block: BlockId, server: ServerId) -> bool {
        self.owner(block) == Some(server) || self.backups_of(block).contains(&server)
    }

    /// The blocks `server` holds a backup of, in id order.
    pub fn backups_on(&self, server: ServerId) -> impl Iterator<Item = BlockId> + '_ {
        self.backups.iter().enumerate().filter(move |(_, b)| b.contains(&server)).map(|(b, _)| b as BlockId)
    }

    /// Server `server` is lost: every block it owned is taken over by its first backup,
    /// and it is no longer a backup of any block; the epoch goes up by one. Returns the
    /// blocks promoted (block, new owner), or the first block it owned with no backup
    /// left (that block is lost: nothing is changed then).
    pub fn fail_server(&mut self, server: ServerId) -> Result<Vec<(BlockId, ServerId)>, BlockId> {
        if let Some(b) = self.blocks_of(server).find(|b| self.backups_of(*b).is_empty()) {
            return Err(b);
        }
        let mut promoted = Vec::new();
        for (b, owner) in self.owners.iter_mut().enumerate() {
            let backups = self.backups.get_mut(b);
            if *owner == server
                && let Some(backups) = backups
            {
                *owner = backups.remove(0);
                promoted.push((b as BlockId, *owner));
            } else if let Some(backups) = backups {
                backups.retain(|s| *s != server);
            }
        }
        self.epoch += 1;
        debug_assert_eq!(self.check_copies(), Ok(()));
        Ok(promoted)
    }

    /// Adds `server` as the last backup of `block` (a copy rebuilt after a loss). Refuses
    /// a server that holds a copy already. The epoch stays: workers only follow owners.
    pub fn add_backup(&mut self, block: BlockId, server: ServerId) -> Result<(), CoreError> {
        if self.owner(block).is_none() {
            return Err(CoreError::UnknownBlock(block));
        }
        if self.holds_copy(block, server) {
            return Err(CoreError::InvalidModel(format!("server {server} holds a copy of block {block} already")));
        }
        if self.backups.len() < self.owners.len() {
            self.backups.resize(self.owners.len(), Vec::new());
        }
        self.backups[block as usize].push(server);
        Ok(())
    }

    /// The invariant of copies: every block has one owner and no server holds two copies
    /// of one block. The first block that breaks it, as an error.
    pub fn check_copies(&self) -> Result<(), String> {
        if !self.backups.is_empty() && self.backups.len() != self.owners.len() {
            return Err(format!("{} blocks have owners, {} have backup lists", self.owners.len(), self.backups.len()));
        }
        for (b, backups) in self.backups.iter().enumerate() {
            let mut copies = backups.clone();
            copies.push(self.owners[b]);
            copies.sort_unstable();
            if copies.windows(2).any(|w| w[0] == w[1]) {
                return Err(format!(
                    "block {b} has two copies on one server: owner {}, backups {backups:?}",
                    self.owners[b]
                ));
            }
        }
        Ok(())
    }
    /// The initial placement of `partition` on `servers` servers (ids `0..servers`), epoch 1.
    /// Refuses no server, and `skewed:IDX` with IDX not below `servers`.
    pub fn initial(kind: PlacementKind, partition: &Partition, servers: u32) -> Result<Self, CoreError> {
        if servers == 0 {
            return Err(CoreError::InvalidModel("no server to place blocks on".into()));
        }
        if let PlacementKind::Skewed(idx) = kind
            && idx >= servers
        {
            return Err(CoreError::UnknownServer { server: idx, servers, what: "placement skewed" });
        }
        let n = partition.blocks.len();
        let owners = match kind {
            PlacementKind::Range => (0..n).map(|i| (i * servers as usize / n) as ServerId).collect(),
            PlacementKind::Hash => partition
                .blocks
                .iter()
                .map(|b| {
                    let name = &partition.tensors[b.tensor as usize].name;
                    let key = format!("{name}#{}", b.offset);
                    (djb2(key.as_bytes()) % u64::from(servers)) as ServerId
                })
                .collect(),
            PlacementKind::RoundRobin => partition.blocks.iter().map(|b| b.tensor % servers).collect(),
            PlacementKind::BestFit => {
                let mut load = vec![0usize; servers as usize];
                let mut owners = vec![0; n];
                for i in largest_first(partition) {
                    let target = (0..servers as usize).min_by_key(|&s| (load[s], s)).unwrap_or(0);
                    load[target] += partition.blocks[i].bytes();
                    owners[i] = target as ServerId;
                }
                owners
            }
            PlacementKind::Skewed(heavy) => {
                let total: usize = partition.blocks.iter().map(|b| b.bytes()).sum();
                let share = (total as f64 * SKEWED_SHARE).ceil() as usize;
                let mut load = vec![0usize; servers as usize];
                let mut owners = vec![heavy; n];
                for i in largest_first(partition) {
                    let target = if load[heavy as usize] < share || servers == 1 {
                        heavy as usize
                    } else {
                        (0..servers as usize)
                            .filter(|&s| s != heavy as usize)
                            .min_by_key(|&s| (load[s], s))
                            .unwrap_or(0)
                    };
                    load[target] += partition.blocks[i].bytes();
                    owners[i] = target as ServerId;
                }
                owners
            }
        };
        Ok(Self::new(1, owners))
    }

    /// Records that `block` is owned by `owner` as of `epoch`: the one way an owner
    /// changes, here and in every crate. The epoch never goes back: it becomes the larger
    /// of the two, since a server's own view may learn of an older change after a newer
    /// one (its hand-over of one block at epoch 7 after another block arrived at epoch 8).
    /// Refuses a block the placement does not have, and then changes nothing.
    pub fn apply(&mut self, block: BlockId, owner: ServerId, epoch: u64) -> Result<(), CoreError> {
        let slot = self.owners.get_mut(block as usize).ok_or(CoreError::UnknownBlock(block))?;
        *slot = owner;
        self.epoch = self.epoch.max(epoch);
        Ok(())
    }

    /// The owner of `block` (none for a retired block).
    pub fn owner(&self, block: BlockId) -> Option<ServerId> {
        self.owners.get(block as usize).copied().filter(|o| *o != RETIRED)
    }

    /// Row block `block` was split into the next two ids ([`Partition::split_rows`]): both
    /// halves get its owner and backups, `block` is retired (owned by [`RETIRED`]), and
    /// the epoch goes up by one. Returns the two new ids. Refused for an unknown or
    /// retired block, and unless the placement covers exactly the blocks before the split.
    pub fn split(&mut self, block: BlockId, blocks_before: usize) -> Result<[BlockId; 2], CoreError> {
        let owner = self.owner(block).ok_or(CoreError::UnknownBlock(block))?;
        if self.owners.len() != blocks_before {
            return Err(CoreError::InvalidModel(format!(
                "the placement has {} blocks, the model {blocks_before}",
                self.owners.len()
            )));
        }
        let first = blocks_before as BlockId;
        self.owners.extend([owner, owner]);
        if !self.backups.is_empty() {
            let backups = self.backups[block as usize].clone();
            self.backups.extend([backups.clone(), backups]);
            self.backups[block as usize].clear();
        }
        self.owners[block as usize] = RETIRED;
        self.epoch += 1;
        debug_assert_eq!(self.check_copies(), Ok(()));
        Ok([first, first + 1])
    }

    /// The blocks owned by `server`, in id order.
    pub fn blocks_of(&self, server: ServerId) -> impl Iterator<Item = BlockId> + '_ {
        self.owners.iter().enumerate().filter(move |(_, o)| **o == server).map(|(b, _)| b as BlockId)
    }
}

/// Row block `block` of `partition` split at row `at` ([`Partition::split_rows`]) and
/// `placement` with it ([`Placement::split`]), its epoch at least `epoch`: new copies of
/// both and the two new ids, or the error with nothing changed. The one way a split
/// reaches a model and its placement, on the scheduler and on every server alike.
pub fn split_row_block(
    partition: &Partition,
    placement: &Placement,
    block: BlockId,
    at: u64,
    epoch: u64,
) -> Result<(Partition, Placement, [BlockId; 2]), CoreError> {
    let (mut partition, mut placement) = (partition.clone(), placement.clone());
    let before = partition.blocks.len();
    let ids = partition.split_rows(block, at)?;
    placement.split(block, before)?;
    placement.epoch = placement.epoch.max(epoch);
    Ok((partition, placement, ids))
}

/// Block indices, largest block first (ties by id).
fn largest_first(partition: &Partition) -> Vec<usize> {
    let mut order: Vec<usize> = (0..partition.blocks.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(partition.blocks[i].len), i));
    order
}

/// djb2 string hash, as BytePS uses to spread keys.
pub fn djb2(bytes: &[u8]) -> u64 {
    bytes.iter().fold(5381u64, |h, b| h.wrapping_mul(33).wrapping_add(u64::from(*b)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Init, TensorSpec};

    fn partition(lens: &[usize]) -> Partition {
        let tensors = lens
            .iter()
            .enumerate()
            .map(|(i, l)| TensorSpec { name: format!("t{i}"), shape: vec![*l], init: Init::Zeros })
            .collect();
        Partition::new(tensors, 4 * 100).unwrap()
    }

    #[test]
    fn every_policy_gives_every_block_exactly_one_valid_owner() {
        let p = partition(&[250, 10, 90, 400, 5]);
        for kind in [
            PlacementKind::Range,
            PlacementKind::Hash,
            PlacementKind::RoundRobin,
            PlacementKind::BestFit,
            PlacementKind::Skewed(0),
        ] {
            for servers in 1..5 {
                let pl = Placement::initial(kind, &p, servers).unwrap();
                assert_eq!(pl.owners.len(), p.blocks.len(), "{kind}");
                assert!(pl.owners.iter().all(|o| *o < servers), "{kind}");
                let total: usize = (0..servers).map(|s| pl.blocks_of(s).count()).sum();
                assert_eq!(total, p.blocks.len());
            }
        }
        assert!(Placement::initial(PlacementKind::Range, &p, 0).is_err());
    }

    #[test]
    fn bestfit_balances_bytes_better_than_range() {
        let p = partition(&[400, 10, 10, 10, 100, 100]);
        let bytes = |pl: &Placement, s| pl.blocks_of(s).map(|b| p.blocks[b as usize].bytes()).sum::<usize>();
        let bf = Placement::initial(PlacementKind::BestFit, &p, 2).unwrap();
        let spread = |pl: &Placement| bytes(pl, 0).abs_diff(bytes(pl, 1));
        assert!(spread(&bf) <= spread(&Placement::initial(PlacementKind::Range, &p, 2).unwrap()));
        assert!(spread(&bf) <= 40);
    }

    #[test]
    fn apply_changes_one_owner_and_never_moves_the_epoch_back() {
        let mut pl = Placement::new(1, vec![0, 0, 1]);
        pl.apply(1, 2, 5).unwrap();
        assert_eq!((pl.epoch, pl.owners.clone()), (5, vec![0, 2, 1]));
        // An older change learned late: the owner is recorded, the epoch stays.
        pl.apply(0, 1, 3).unwrap();
        assert_eq!((pl.epoch, pl.owners.clone()), (5, vec![1, 2, 1]));
        let before = pl.clone();
        assert_eq!(pl.apply(3, 0, 9), Err(CoreError::UnknownBlock(3)));
        assert_eq!(pl, before, "a refused change changes nothing");
    }

    #[test]
    fn replicas_go_on_the_next_servers_and_a_lost_server_promotes_its_first_backup() {
        let pl = Placement::new(1, vec![0, 1, 2, 2]).with_replicas(2, 3).unwrap();
        assert_eq!(pl.backups, vec![vec![1], vec![2], vec![0], vec![0]]);
        assert!(Placement::new(1, vec![0]).with_replicas(3, 2).is_err(), "more copies than servers");
        let mut lost = pl.clone();
        let promoted = lost.fail_server(2).unwrap();
        assert_eq!(promoted, vec![(2, 0), (3, 0)]);
        assert_eq!((lost.epoch, lost.owners.clone()), (2, vec![0, 1, 0, 0]));
        assert_eq!(lost.backups, vec![vec![1], vec![], vec![], vec![]]);
        assert_eq!(lost.check_copies(), Ok(()));
        // Block 1 has no backup left: losing its owner loses it, and changes nothing.
        let before = lost.clone();
        assert_eq!(lost.fail_server(1), Err(1));
        assert_eq!(lost, before);
        lost.add_backup(1, 0).unwrap();
        assert_eq!((lost.backups_of(1), lost.epoch), (&[0][..], 2));
        assert!(lost.add_backup(1, 1).is_err(), "the owner holds a copy");
        assert!(lost.add_backup(9, 2).is_err());
        let two = Placement { backups: vec![vec![0], vec![], vec![], vec![]], ..lost.clone() };
        assert!(two.check_copies().unwrap_err().contains("block 0"));
    }

    #[test]
    fn parses_kinds() {
        for s in ["range", "hash", "roundrobin", "bestfit", "skewed:0", "skewed:3"] {
            assert_eq!(s.parse::<PlacementKind>().unwrap().to_string(), s);
        }
        assert_eq!("Skewed: 2".parse::<PlacementKind>(), Ok(PlacementKind::Skewed(2)));
        for bad in ["random", "skewed", "skewed:", "skewed:-1", "skewed:x", "bestfit:1"] {
            assert!(bad.parse::<PlacementKind>().is_err(), "{bad}");
        }
    }

    #[test]
    fn skewed_puts_most_bytes_on_one_server() {
        // ResNet-like: a few large tensors (conv, fc), many small ones (batch norm, bias).
        let mut lens = vec![2_359_296, 1_048_576, 589_824, 2_048_000, 147_456, 36_864];
        lens.extend((0..40).map(|i| 64 << (i % 4)));
        let tensors = lens
            .iter()
            .enumerate()
            .map(|(i, l)| TensorSpec { name: format!("t{i}"), shape: vec![*l], init: Init::Zeros })
            .collect();
        let p = Partition::new(tensors, 1 << 20).unwrap();
        let total: usize = p.blocks.iter().map(|b| b.bytes()).sum();
        for idx in 0..4 {
            let pl = Placement::initial(PlacementKind::Skewed(idx), &p, 4).unwrap();
            assert_eq!(pl.owners.len(), p.blocks.len());
            assert!(pl.owners.iter().all(|o| *o < 4));
            let bytes = |s| pl.blocks_of(s).map(|b| p.blocks[b as usize].bytes()).sum::<usize>();
            assert!(bytes(idx) as f64 >= SKEWED_SHARE * total as f64, "server {idx}: {} of {total}", bytes(idx));
            assert!(bytes(idx) < total, "the other servers hold something");
            // The rest is spread: no other server is empty, none holds more than the heavy one.
            for s in (0..4).filter(|s| *s != idx) {
                assert!(bytes(s) > 0 && bytes(s) < bytes(idx), "server {s}");
            }
        }
        let one = Placement::initial(PlacementKind::Skewed(0), &p, 1).unwrap();
        assert!(one.owners.iter().all(|o| *o == 0));
        let err = Placement::initial(PlacementKind::Skewed(4), &p, 4).unwrap_err();
        assert!(matches!(err, CoreError::UnknownServer { server: 4, servers: 4, .. }), "{err}");
        assert!(err.to_string().contains("servers 0..4"), "{err}");
    }

    #[test]
    fn a_split_block_is_retired_and_its_halves_keep_its_owner_and_backups() {
        let mut pl = Placement::new(3, vec![0, 1, 0]).with_replicas(2, 2).unwrap();
        assert_eq!(pl.split(1, 3).unwrap(), [3, 4]);
        assert_eq!(pl.epoch, 4);
        assert_eq!((pl.owner(1), pl.owner(3), pl.owner(4)), (None, Some(1), Some(1)));
        assert_eq!((pl.backups_of(3), pl.backups_of(4), pl.backups_of(1)), (&[0][..], &[0][..], &[][..]));
        assert_eq!(pl.blocks_of(1).collect::<Vec<_>>(), [3, 4]);
        assert_eq!(pl.check_copies(), Ok(()));
        assert!(pl.split(1, 5).is_err(), "a retired block");
        assert!(pl.split(0, 3).is_err(), "the model has other blocks than the placement");
    }
}
