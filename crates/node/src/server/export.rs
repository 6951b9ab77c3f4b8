//! `elasticps export` at a server (docs/PROTOCOL.md §6.14): one page of a block it owns,
//! for serving. A row block answers its rows pushed since the asker's `since` (the
//! block's `steps` of the previous export), in ascending id order, a bounded page at a
//! time; a dense block answers its whole values. A block not served here is answered
//! `Moved` (to no server once it was split: the layout has its halves); one migrating is
//! answered `NotReady` (its copy at the new owner would not know it was exported, so a
//! later eviction there could go unreported).

use elasticps_core::CoreError;
use elasticps_core::model::BlockId;
use elasticps_wire::{Control, ErrorCode, Message};

use super::config::{Refusal, error};
use super::{Phase, Server, Slot};

/// At most this many rows in one `ExportedBlock` reply.
pub const EXPORT_PAGE_ROWS: usize = 65_536;
/// At most about this many bytes of ids and values in one `ExportedBlock` reply (fewer
/// rows per page for wide rows; at least one row).
pub const EXPORT_PAGE_BYTES: usize = 8 << 20;

/// Rows (and deleted keys, 8 bytes each, fewer than a row's) per page for rows of `dim`
/// values, with replies of at most `max_payload` bytes: within [`EXPORT_PAGE_ROWS`] and
/// [`EXPORT_PAGE_BYTES`] (half the payload limit if that is smaller), at least 1.
pub fn page_rows(dim: u32, max_payload: u64) -> usize {
    let row_bytes = 8 + 4 * u64::from(dim.max(1));
    let budget = (EXPORT_PAGE_BYTES as u64).min(max_payload / 2);
    usize::try_from(budget / row_bytes).unwrap_or(usize::MAX).clamp(1, EXPORT_PAGE_ROWS)
}

impl Server {
    /// The answer to `ExportBlock` of `block`: a page, `Moved`, `NotReady` (no assignment
    /// yet, or the block migrates: try again) or `BadRequest` (a `since` older than the
    /// evictions the block remembers, a dense block too large for one reply).
    pub(super) fn export_request(&mut self, block: BlockId, since: Option<u64>, after: Option<u64>) -> Message {
        let max_payload = self.max_payload;
        let Some(shard) = self.shard.as_ref() else { return Refusal::NotReady.reply(block) };
        let o = match self.slots.get_mut(&block) {
            Some(Slot::Owned(o)) => o,
            Some(Slot::Gone { .. }) | None => return shard.refusal(block).reply(block),
        };
        if !matches!(o.phase, Phase::Serving) {
            return error(ErrorCode::NotReady, format!("block {block} is migrating: export it again once it moved"));
        }
        let spec = *o.block.spec();
        let Some((_, _, dim)) = spec.row_range() else {
            let values = o.block.values();
            if (values.len() as u64).saturating_mul(4) > max_payload {
                let message = format!(
                    "dense block {block} holds {} bytes, more than one reply may carry ({max_payload}): raise \
                     --max-frame-mib",
                    values.len() * 4
                );
                return error(ErrorCode::BadRequest, message);
            }
            let values = values.as_ref().clone();
            return Control::ExportedBlock {
                block,
                steps: 0,
                ids: Vec::new(),
                values,
                deleted: Vec::new(),
                more: false,
            }
            .into();
        };
        match o.block.export_rows(since, after, page_rows(dim, max_payload)) {
            Ok(page) => {
                if after.is_none() {
                    tracing::debug!(
                        server = shard.id,
                        block,
                        ?since,
                        steps = page.steps,
                        rows = page.ids.len(),
                        deleted = page.deleted.len(),
                        more = page.more,
                        "block exported"
                    );
                }
                Control::ExportedBlock {
                    block,
                    steps: page.steps,
                    ids: page.ids,
                    values: page.values,
                    deleted: page.deleted,
                    more: page.more,
                }
                .into()
            }
            Err(e @ CoreError::ExportTooOld { .. }) => {
                tracing::warn!(server = shard.id, block, ?since, error = %e, "export refused");
                error(ErrorCode::BadRequest, format!("block {block}: {e}"))
            }
            Err(e) => error(ErrorCode::BadRequest, format!("block {block}: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use elasticps_core::block::ShardConfig;
    use elasticps_core::model::{Init, Partition, TableSpec, TensorSpec};
    use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
    use elasticps_core::placement::{Placement, PlacementKind, RETIRED, ServerId};
    use elasticps_core::rows::{KEY_POSITIONS, RowInit, RowLimits, SparseOptimizer};
    use elasticps_core::sync::SyncPolicy;
    use elasticps_wire::{
        Assignment, Control, Credential, ErrorCode, Injection, KeyId, Message, PeerRole, RowIds, Values,
    };

    use super::*;
    use crate::server::{Action, Event};

    /// The dense block 0 ("w", 4 values) on server 0 and hashed table "emb" (dim 2, one
    /// key range: block 1, rows bounded by `max_rows`) on server 1.
    fn assignment(id: ServerId, max_rows: u64) -> Assignment {
        let tensors = vec![TensorSpec { name: "w".into(), shape: vec![4], init: Init::Constant(0.25) }];
        let table = TableSpec::hashed("emb", 2, 1)
            .with_init(RowInit::Constant(0.5))
            .with_optimizer(SparseOptimizer::Sgd { lr: 1.0 })
            .with_limits(RowLimits { max_rows, ..RowLimits::default() });
        let partition = Partition::with_tables(tensors, vec![table], 16).unwrap();
        let placement = Placement::initial(PlacementKind::Range, &partition, 2).unwrap();
        assert_eq!((placement.owner(0), placement.owner(1)), (Some(0), Some(1)));
        let optimizer = OptimizerConfig { kind: OptimizerKind::Sgd, lr: 1.0, aggregate: false, weight_decay: 0.0 };
        Assignment {
            server_id: id,
            partition,
            placement,
            config: ShardConfig { sync: SyncPolicy::Asp, optimizer, workers: 1 },
            seed: 7,
            inject: Injection::default(),
        }
    }

    /// Server `id`, assigned, replies of at most `max_payload` bytes; connection 1 is
    /// worker 0's, connection 2 an operator's (the cluster key, no `Hello`).
    fn server(id: ServerId, max_rows: u64, max_payload: u32) -> Server {
        let mut s = Server::new(format!("addr{id}")).with_max_payload(max_payload);
        s.start(0);
        let credential = Credential::issue(b"", 0, PeerRole::Server, id);
        let welcome = Control::Welcome { node_id: id, num_workers: 1, num_servers: 2, credential };
        s.handle(0, Event::FromScheduler { request_id: 1, msg: welcome.into() });
        let assign = Control::Assign(Box::new(assignment(id, max_rows)));
        s.handle(0, Event::FromScheduler { request_id: 0, msg: assign.into() });
        s.handle(0, Event::Opened { conn: 1, key: KeyId::Cluster });
        let hello = Control::Hello { credential: Credential::issue(b"", 0, PeerRole::Worker, 0) };
        s.handle(0, Event::Received { conn: 1, request_id: 0, msg: hello.into() });
        assert!(s.introduced(1));
        s.handle(0, Event::Opened { conn: 2, key: KeyId::Cluster });
        s
    }

    /// One reply to `msg` on `conn`.
    fn ask(s: &mut Server, conn: u64, msg: Message) -> Message {
        let acts = s.handle(0, Event::Received { conn, request_id: 9, msg });
        let replies: Vec<Message> = acts
            .into_iter()
            .filter_map(|a| match a {
                Action::Reply { conn: c, request_id: 9, msg } if c == conn => Some(msg),
                _ => None,
            })
            .collect();
        assert_eq!(replies.len(), 1, "one reply: {replies:?}");
        replies.into_iter().next().unwrap()
    }

    fn export(s: &mut Server, block: BlockId, since: Option<u64>, after: Option<u64>) -> Message {
        ask(s, 2, Control::ExportBlock { block, since, after }.into())
    }

    /// Worker 0 pushes gradient `g` (both values) to each of `keys` of block 1.
    fn push(s: &mut Server, clock: u32, keys: &[u64], g: f32) {
        let grads = vec![g; keys.len() * 2];
        let msg = Message::PushRows {
            block: 1,
            clock,
            dim: 2,
            ids: RowIds::from_slice(keys),
            grads: Values::from_vec(grads),
        };
        let got = ask(s, 1, msg);
        assert!(matches!(got, Message::PushAck { .. }), "{got:?}");
    }

    /// A page's fields: (steps, ids, values, deleted, more).
    fn page(m: Message) -> (u64, Vec<u64>, Vec<f32>, Vec<u64>, bool) {
        match m {
            Message::Control(Control::ExportedBlock { block: 1, steps, ids, values, deleted, more }) => {
                (steps, ids, values, deleted, more)
            }
            other => panic!("a page of block 1: {other:?}"),
        }
    }

    fn error_of(m: &Message) -> (ErrorCode, String) {
        match m {
            Message::Error(e) => (e.code, e.message.clone()),
            other => panic!("an error: {other:?}"),
        }
    }

    #[test]
    fn pages_are_bounded_by_rows_and_bytes() {
        let max = elasticps_wire::DEFAULT_MAX_PAYLOAD.into();
        assert_eq!(page_rows(1, max), EXPORT_PAGE_ROWS, "narrow rows: the row bound");
        assert_eq!(page_rows(1 << 16, max), EXPORT_PAGE_BYTES / (8 + 4 * (1 << 16)), "wide rows: the byte bound");
        assert_eq!(page_rows(u32::MAX, max), 1, "at least one row");
        assert_eq!(page_rows(2, 64), 2, "half a small payload limit: 32 bytes of 16-byte rows");
        assert_eq!(page_rows(0, 0), 1);
    }

    #[test]
    fn a_row_block_is_read_in_pages_of_ascending_ids() {
        // Rows of 16 bytes (an 8-byte id and two f32) and replies of at most 64 bytes:
        // 2 rows per page.
        let mut s = server(1, 0, 64);
        let keys = [u64::MAX, 3, 1 << 40, 17, 5];
        push(&mut s, 0, &keys, 1.0);
        let mut sorted = keys.to_vec();
        sorted.sort_unstable();
        let (mut got, mut after, mut first_steps) = (Vec::new(), None, None);
        for n in 0.. {
            assert!(n < 5, "too many pages");
            let (steps, ids, values, deleted, more) = page(export(&mut s, 1, None, after));
            assert!(ids.len() <= 2 && !ids.is_empty(), "{ids:?}");
            assert_eq!(values, vec![-0.5; ids.len() * 2], "0.5 - 1.0 each");
            assert!(deleted.is_empty());
            assert_eq!(*first_steps.get_or_insert(steps), steps, "every page repeats the first page's steps");
            after = ids.last().copied();
            got.extend(ids);
            if !more {
                break;
            }
        }
        assert_eq!(got, sorted);
        assert_eq!(first_steps, Some(1), "one push applied");
        // Since that export: only the rows pushed after it.
        push(&mut s, 1, &[17, 99], 1.0);
        let (steps, ids, values, _, more) = page(export(&mut s, 1, first_steps, None));
        assert_eq!((steps, ids, values, more), (2, vec![17, 99], vec![-1.5, -1.5, -0.5, -0.5], false));
        let (_, ids, _, _, _) = page(export(&mut s, 1, Some(2), None));
        assert!(ids.is_empty(), "nothing changed since step 2");
    }

    #[test]
    fn evicted_keys_come_as_deleted_and_a_forgotten_step_is_refused() {
        // At most 4 rows in the block (2 per server, 2 servers).
        let mut s = server(1, 2, elasticps_wire::DEFAULT_MAX_PAYLOAD);
        push(&mut s, 0, &[1, 2, 3, 4], 1.0);
        let (since, ids, ..) = page(export(&mut s, 1, None, None));
        assert_eq!(ids, vec![1, 2, 3, 4]);
        // Four new keys evict the exported ones: the next delta says so.
        push(&mut s, 1, &[5, 6, 7, 8], 1.0);
        let (_, ids, _, deleted, _) = page(export(&mut s, 1, Some(since), None));
        assert!(ids.iter().all(|k| (5..=8).contains(k)), "{ids:?}");
        assert!(!deleted.is_empty() && deleted.iter().all(|k| (1..=4).contains(k)), "{deleted:?}");
        let present: Vec<u64> = (1..=8).filter(|k| !deleted.contains(k)).collect();
        let (_, all, ..) = page(export(&mut s, 1, None, None));
        assert_eq!(all, present, "a full export holds what the delta leaves");
        // Exported rows evicted until the oldest evictions are forgotten: a delta since the
        // first export is refused, nothing changed, and a full export still answers.
        let mut clock = 2;
        let refused = loop {
            assert!(clock < 200_000, "the evictions were never forgotten");
            let keys: Vec<u64> = (0..4).map(|i| 1_000 + 4 * u64::from(clock) + i).collect();
            push(&mut s, clock, &keys, 1.0);
            page(export(&mut s, 1, None, None));
            clock += 1;
            if clock % 64 == 0 {
                let m = export(&mut s, 1, Some(since), None);
                if matches!(m, Message::Error(_)) {
                    break m;
                }
            }
        };
        let (code, message) = error_of(&refused);
        assert_eq!(code, ErrorCode::BadRequest);
        assert!(message.contains("block 1") && message.contains("full export"), "{message}");
        assert!(matches!(export(&mut s, 1, None, None), Message::Control(Control::ExportedBlock { .. })));
    }

    #[test]
    fn a_dense_block_answers_its_values_and_one_elsewhere_or_split_is_moved() {
        let mut s0 = server(0, 0, elasticps_wire::DEFAULT_MAX_PAYLOAD);
        let dense = Control::ExportedBlock {
            block: 0,
            steps: 0,
            ids: vec![],
            values: vec![0.25; 4],
            deleted: vec![],
            more: false,
        };
        assert_eq!(export(&mut s0, 0, None, None), dense.into());
        assert_eq!(export(&mut s0, 1, None, None), Control::Moved { block: 1, owner: 1, epoch: 1 }.into());
        let (code, message) = error_of(&export(&mut s0, 7, None, None));
        assert_eq!(code, ErrorCode::UnknownBlock, "{message}");
        // A dense block larger than one reply is refused, saying so.
        let mut small = server(0, 0, 8);
        let (code, message) = error_of(&export(&mut small, 0, None, None));
        assert_eq!(code, ErrorCode::BadRequest);
        assert!(message.contains("--max-frame-mib"), "{message}");
        // A split block: moved to no server.
        let mut s1 = server(1, 0, elasticps_wire::DEFAULT_MAX_PAYLOAD);
        push(&mut s1, 0, &[1, 2], 1.0);
        let split = Control::SplitBlock { block: 1, at: KEY_POSITIONS / 2, epoch: 2, recorded: false };
        s1.handle(0, Event::FromScheduler { request_id: 0, msg: split.into() });
        assert_eq!(export(&mut s1, 1, None, None), Control::Moved { block: 1, owner: RETIRED, epoch: 2 }.into());
        // Its halves answer, together every row.
        let mut ids = Vec::new();
        for half in [2, 3] {
            match export(&mut s1, half, None, None) {
                Message::Control(Control::ExportedBlock { block, ids: got, .. }) if block == half => ids.extend(got),
                other => panic!("a page of block {half}: {other:?}"),
            }
        }
        ids.sort_unstable();
        assert_eq!(ids, vec![1, 2]);
    }

    #[test]
    fn a_server_unassigned_says_not_ready_and_another_server_may_not_export() {
        let mut s = Server::new("addr");
        s.handle(0, Event::Opened { conn: 2, key: KeyId::Cluster });
        let (code, _) = error_of(&export(&mut s, 0, None, None));
        assert_eq!(code, ErrorCode::NotReady);
        let mut s = server(1, 0, elasticps_wire::DEFAULT_MAX_PAYLOAD);
        s.handle(0, Event::Opened { conn: 3, key: KeyId::Cluster });
        let hello = Control::Hello { credential: Credential::issue(b"", 0, PeerRole::Server, 0) };
        s.handle(0, Event::Received { conn: 3, request_id: 0, msg: hello.into() });
        let (code, _) = error_of(&ask(&mut s, 3, Control::ExportBlock { block: 1, since: None, after: None }.into()));
        assert_eq!(code, ErrorCode::Forbidden);
        // A worker's own connection may.
        let got = ask(&mut s, 1, Control::ExportBlock { block: 1, since: None, after: None }.into());
        assert!(matches!(got, Message::Control(Control::ExportedBlock { .. })), "{got:?}");
    }
}
