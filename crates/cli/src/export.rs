//! `elasticps export`: a running job's values for serving, as docs/EXPORT.md describes
//! them: every row changed since the last export (all of them without `--since`) and the
//! dense tensors, as binary shards and a manifest (JSON) written last.
//!
//! The conversation is docs/PROTOCOL.md §6.14: the layout from the scheduler (`GetLayout`,
//! without registering), then each block from its owner (`ExportBlock`, page by page, on a
//! data connection without `Hello`). A block that moved, was split or is migrating is
//! exported again from scratch at its owner in a fresh layout (its halves, for a split
//! one), a bounded number of times.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use elasticps_core::model::{BlockId, BlockSpec, Partition};
use elasticps_core::placement::ServerId;
use elasticps_launch::args::NetArgs;
use elasticps_runtime::RuntimeError;
use elasticps_runtime::conn::{FrameReader, Outbox};
use elasticps_runtime::durable::write_atomic;
use elasticps_runtime::session::SchedLink;
use elasticps_wire::{Codec, Control, ErrorCode, Layout, Message};
use serde::{Deserialize, Serialize};

/// The manifest's name in an export's directory.
pub const MANIFEST: &str = "MANIFEST.json";
/// The manifest format this program writes (`"format"`).
pub const FORMAT: u32 = 1;
/// How long the scheduler may take to answer `GetLayout` (it answers once every server
/// holds its blocks).
const LAYOUT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a server may take to answer one `ExportBlock`.
const PAGE_TIMEOUT: Duration = Duration::from_secs(60);
/// How many times one block is exported again from scratch (it moved, was split, is
/// migrating, or its server's connection failed) before the export gives up.
const MAX_ATTEMPTS: u32 = 20;
/// How long to wait before exporting a block again that is migrating (`NotReady`).
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// `elasticps export`: write a running job's values for serving.
#[derive(Args, Clone, Debug)]
pub struct ExportCmd {
    /// The scheduler's address.
    #[arg(long, env = "ELASTICPS_SCHEDULER", default_value = "127.0.0.1:7000")]
    pub scheduler: String,
    /// The directory to write (created; it must not hold an export already).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// A previous export: write only the rows changed since it (a delta whose `parent`
    /// is PREV_DIR). Without it, every row (a full export).
    #[arg(long, value_name = "PREV_DIR")]
    pub since: Option<PathBuf>,
    /// Transport settings (`--secret` or `--worker-secret`, as the job's).
    #[command(flatten)]
    pub net: NetArgs,
}

/// An export's manifest (`MANIFEST.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The export this one is a delta of, relative to this export's directory (or
    /// absolute); `None` for a full export.
    pub parent: Option<String>,
    /// The dense tensors, whole.
    pub tensors: Vec<TensorEntry>,
    /// The tables' rows changed since the parent.
    pub tables: Vec<TableEntry>,
}

/// One dense tensor of a manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Its name in the model.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its values (f32 little-endian, row-major), relative to the export's directory.
    pub file: String,
}

/// One table of a manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableEntry {
    /// Its name in the model.
    pub name: String,
    /// Values per row.
    pub dim: u32,
    /// Keyed by any u64 (true) or by row index.
    pub hashed: bool,
    /// One per block of the table.
    pub shards: Vec<ShardEntry>,
}

/// One block of a table in a manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// The block id.
    pub block: BlockId,
    /// First row (key position, for a hashed table) of the block.
    pub start: u64,
    /// One past its last.
    pub end: u64,
    /// The block's step count when it was read: what the next export asks changes since.
    pub steps: u64,
    /// Rows in the shard.
    pub rows: u64,
    /// The rows' ids (u64 little-endian, ascending).
    pub ids: String,
    /// Their values (f32 little-endian, `rows x dim`, row-major).
    pub values: String,
    /// Keys removed since the parent (u64 little-endian, ascending).
    pub deleted: String,
}

/// Runs `elasticps export`.
pub async fn export(cmd: ExportCmd) -> anyhow::Result<()> {
    cmd.net.install()?;
    if cmd.out.join(MANIFEST).exists() {
        bail!("{} holds an export already: choose a new directory", cmd.out.display());
    }
    let previous = match &cmd.since {
        Some(dir) => Some(read_manifest(dir)?),
        None => None,
    };
    let codec = cmd.net.worker_codec();
    let mut ex = Exporter { scheduler: cmd.scheduler.clone(), codec, conns: HashMap::new(), next_request: 1 };
    let layout = ex.layout().await?;
    let partition = layout.partition.clone();

    let mut tensors = Vec::new();
    for (t, spec) in partition.tensors.iter().enumerate() {
        let mut values = vec![0f32; spec.len()];
        for b in partition.blocks.iter().filter(|b| !b.is_rows() && b.tensor as usize == t) {
            let got = ex.dense_block(b.id).await?;
            if got.len() != b.len {
                bail!("block {} of tensor {:?} came with {} values, not {}", b.id, spec.name, got.len(), b.len);
            }
            values[b.offset..b.offset + b.len].copy_from_slice(&got);
        }
        let file = format!("tensor-{t}.f32");
        write_atomic(&cmd.out.join(&file), &f32_bytes(&values))?;
        tensors.push(TensorEntry { name: spec.name.clone(), shape: spec.shape.clone(), file });
    }

    let mut tables = Vec::new();
    for (t, spec) in partition.tables.iter().enumerate() {
        let prev = previous.as_ref().and_then(|m| m.tables.iter().find(|e| e.name == spec.name));
        let mut shards = Vec::new();
        let blocks: Vec<BlockSpec> = partition.table_blocks(t as u32).into_iter().copied().collect();
        for b in blocks {
            let since = prev.and_then(|p| since_of(p, &b));
            for (spec_b, rows) in ex.row_block(b, since).await? {
                let (start, end, _) = spec_b.row_range().unwrap_or_default();
                let stem = format!("table-{t}-block-{}", spec_b.id);
                let entry = ShardEntry {
                    block: spec_b.id,
                    start,
                    end,
                    steps: rows.steps,
                    rows: rows.ids.len() as u64,
                    ids: format!("{stem}.ids"),
                    values: format!("{stem}.f32"),
                    deleted: format!("{stem}.deleted"),
                };
                write_atomic(&cmd.out.join(&entry.ids), &u64_bytes(&rows.ids))?;
                write_atomic(&cmd.out.join(&entry.values), &f32_bytes(&rows.values))?;
                write_atomic(&cmd.out.join(&entry.deleted), &u64_bytes(&rows.deleted))?;
                shards.push(entry);
            }
        }
        shards.sort_by_key(|s| s.start);
        tables.push(TableEntry { name: spec.name.clone(), dim: spec.dim, hashed: spec.is_hashed(), shards });
    }

    let parent = cmd.since.as_deref().map(|p| relative_to(p, &cmd.out));
    let manifest = Manifest { format: FORMAT, parent, tensors, tables };
    let text = serde_json::to_string_pretty(&manifest).context("cannot write the manifest as JSON")?;
    write_atomic(&cmd.out.join(MANIFEST), text.as_bytes())?;
    let rows: u64 = manifest.tables.iter().flat_map(|t| &t.shards).map(|s| s.rows).sum();
    let deleted: u64 = manifest
        .tables
        .iter()
        .flat_map(|t| &t.shards)
        .map(|s| std::fs::metadata(cmd.out.join(&s.deleted)).map_or(0, |m| m.len() / 8))
        .sum();
    let kind = if manifest.parent.is_some() { "delta" } else { "full export" };
    println!(
        "{kind} written to {}: {} tensors, {} tables, {rows} rows, {deleted} deleted keys",
        cmd.out.display(),
        manifest.tensors.len(),
        manifest.tables.len()
    );
    Ok(())
}

/// Reads and checks the manifest of the export in `dir`.
pub fn read_manifest(dir: &Path) -> anyhow::Result<Manifest> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read the export manifest {}: is it an export?", path.display()))?;
    let m: Manifest = serde_json::from_str(&text)
        .with_context(|| format!("{} is not an export manifest (format {FORMAT})", path.display()))?;
    if m.format != FORMAT {
        bail!("{} is of format {}; this program reads format {FORMAT}", path.display(), m.format);
    }
    Ok(m)
}

/// The `since` of block `b` given the previous export's entry of its table: the steps of
/// the same block, or (a half of a block split since) the smallest steps of the previous
/// shards its range overlaps (the block it was split from); `None` (every row) when none
/// does.
pub fn since_of(prev: &TableEntry, b: &BlockSpec) -> Option<u64> {
    if let Some(s) = prev.shards.iter().find(|s| s.block == b.id) {
        return Some(s.steps);
    }
    let (start, end, _) = b.row_range().unwrap_or_default();
    prev.shards.iter().filter(|s| s.start < end && start < s.end).map(|s| s.steps).min()
}

/// `path` as seen from directory `from`: relative if both are (or resolve to) paths under a
/// common root, else absolute, else as given.
fn relative_to(path: &Path, from: &Path) -> String {
    let abs = |p: &Path| std::path::absolute(p).ok().map(|p| normal(&p));
    match (abs(path), abs(from)) {
        (Some(p), Some(f)) => {
            let common = p.components().zip(f.components()).take_while(|(a, b)| a == b).count();
            let mut rel = PathBuf::new();
            for _ in common..f.components().count() {
                rel.push("..");
            }
            for c in p.components().skip(common) {
                rel.push(c);
            }
            if rel.as_os_str().is_empty() { ".".into() } else { rel.to_string_lossy().into_owned() }
        }
        _ => path.to_string_lossy().into_owned(),
    }
}

/// `p` without `.` and with `..` applied.
fn normal(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn u64_bytes(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A row block's rows as exported: every page together.
#[derive(Debug, Default)]
struct Rows {
    steps: u64,
    ids: Vec<u64>,
    values: Vec<f32>,
    deleted: Vec<u64>,
}

/// Why one attempt at a block did not end with its rows.
enum Retry {
    /// Ask the layout again: the block moved or was split (or its owner is unknown).
    Layout(String),
    /// Ask again in a moment: the block is migrating.
    Later(String),
}

/// The export's connections: the scheduler's address, one data connection per server.
struct Exporter {
    scheduler: String,
    codec: Codec,
    conns: HashMap<ServerId, (String, FrameReader, Outbox)>,
    next_request: u64,
}

impl Exporter {
    /// The current layout, from a connection of its own (an operator's connection that
    /// asks nothing for 10 s is closed by the scheduler).
    async fn layout(&mut self) -> anyhow::Result<Layout> {
        let addr = &self.scheduler;
        let (link, _notes) = SchedLink::operator(addr, self.codec.clone())
            .await
            .with_context(|| format!("cannot reach the scheduler at {addr}"))?;
        let reply = link
            .call(Control::GetLayout.into(), LAYOUT_TIMEOUT, || format!("the scheduler at {addr} to send the layout"))
            .await;
        link.close();
        match reply {
            Ok(Message::Control(Control::Layout(l))) => Ok(l),
            Ok(other) => bail!("the scheduler at {addr} answered GetLayout with a {:?} frame", other.kind()),
            Err(RuntimeError::Remote { reply, .. }) => {
                bail!("the scheduler at {addr} refused the layout: {} ({:?})", reply.message, reply.code)
            }
            Err(e @ RuntimeError::Closed(_)) => Err(anyhow::Error::new(e).context(format!(
                "the scheduler at {addr} closed the connection without the layout (a wrong --secret / \
                 ELASTICPS_SECRET or --worker-secret / ELASTICPS_WORKER_SECRET?)"
            ))),
            Err(e) => Err(anyhow::Error::new(e).context(format!("no layout from the scheduler at {addr}"))),
        }
    }

    /// A dense block's values, from its owner.
    async fn dense_block(&mut self, block: BlockId) -> anyhow::Result<Vec<f32>> {
        let mut why = String::new();
        for attempt in 0..MAX_ATTEMPTS {
            if attempt > 0 {
                tracing::info!(block, attempt, reason = %why, "block exported again");
            }
            let layout = self.layout().await?;
            match self.ask(&layout, block, None, None).await? {
                Ok(page) => return Ok(page.values),
                Err(Retry::Layout(w)) => why = w,
                Err(Retry::Later(w)) => {
                    why = w;
                    pause().await;
                }
            }
        }
        bail!("block {block} was not exported after {MAX_ATTEMPTS} attempts: {why}")
    }

    /// Row block `b`'s rows changed since `since`, page by page from its owner; if it was
    /// split meanwhile, each of its halves' (recursively), with the same `since`.
    async fn row_block(&mut self, b: BlockSpec, since: Option<u64>) -> anyhow::Result<Vec<(BlockSpec, Rows)>> {
        let mut todo = vec![(b, 0u32)];
        let mut done = Vec::new();
        let mut layout: Option<Layout> = None;
        while let Some((b, attempts)) = todo.pop() {
            if attempts >= MAX_ATTEMPTS {
                bail!("block {} was not exported after {MAX_ATTEMPTS} attempts", b.id);
            }
            let current = match layout.take() {
                Some(l) => l,
                None => self.layout().await?,
            };
            if current.partition.block(b.id).is_ok_and(|s| s.is_retired()) {
                // Split since: its halves, found in the new layout, from scratch.
                let halves = halves_of(&current.partition, &b);
                tracing::info!(block = b.id, ?halves, "block split: its halves are exported");
                todo.extend(halves.into_iter().map(|h| (h, attempts + 1)));
                layout = Some(current);
                continue;
            }
            match self.pages(&current, &b, since).await? {
                Ok(rows) => {
                    done.push((b, rows));
                    layout = Some(current);
                }
                Err(Retry::Layout(why)) => {
                    tracing::info!(block = b.id, reason = %why, "block exported again from scratch");
                    todo.push((b, attempts + 1));
                }
                Err(Retry::Later(why)) => {
                    tracing::info!(block = b.id, reason = %why, "block exported again in a moment");
                    pause().await;
                    todo.push((b, attempts + 1));
                }
            }
        }
        Ok(done)
    }

    /// Every page of row block `b` at its owner in `layout`.
    async fn pages(
        &mut self,
        layout: &Layout,
        b: &BlockSpec,
        since: Option<u64>,
    ) -> anyhow::Result<Result<Rows, Retry>> {
        let mut rows = Rows::default();
        let mut after = None;
        loop {
            let page = match self.ask(layout, b.id, since, after).await? {
                Ok(p) => p,
                Err(r) => return Ok(Err(r)),
            };
            if after.is_none() {
                rows.steps = page.steps;
            }
            let past = |k: &u64| after.is_none_or(|a| *k > a);
            if !page.ids.iter().chain(&page.deleted).all(past)
                || page.ids.windows(2).any(|w| w[0] >= w[1])
                || page.deleted.windows(2).any(|w| w[0] >= w[1])
            {
                bail!("block {}: a page whose keys are not ascending past {after:?}", b.id);
            }
            // Rows and deleted keys are paged together, by key.
            after = page.ids.last().into_iter().chain(page.deleted.last()).max().copied().or(after);
            rows.ids.extend(page.ids);
            rows.values.extend(page.values);
            rows.deleted.extend(page.deleted);
            if !page.more {
                return Ok(Ok(rows));
            }
            if after.is_none() {
                bail!("block {}: an empty page that says more follow", b.id);
            }
        }
    }

    /// One `ExportBlock` of `block` at its owner in `layout`.
    async fn ask(
        &mut self,
        layout: &Layout,
        block: BlockId,
        since: Option<u64>,
        after: Option<u64>,
    ) -> anyhow::Result<Result<Page, Retry>> {
        let Some(owner) = layout.placement.owner(block) else {
            return Ok(Err(Retry::Layout(format!("block {block} has no owner in the layout"))));
        };
        let Some(addr) = layout.servers.iter().find(|s| s.id == owner).map(|s| s.addr.clone()) else {
            return Ok(Err(Retry::Layout(format!("server {owner} of block {block} has no address in the layout"))));
        };
        let request_id = self.next_request;
        self.next_request += 1;
        let reply = match self.call(owner, &addr, request_id, Control::ExportBlock { block, since, after }.into()).await
        {
            Ok(m) => m,
            Err(e) => {
                // The connection failed (the server left, or closed an idle connection):
                // dropped, and the block asked again.
                self.conns.remove(&owner);
                return Ok(Err(Retry::Layout(format!("server {owner} at {addr}: {e:#}"))));
            }
        };
        match reply {
            Message::Control(Control::ExportedBlock { block: got, steps, ids, values, deleted, more })
                if got == block =>
            {
                Ok(Ok(Page { steps, ids, values, deleted, more }))
            }
            Message::Control(Control::Moved { owner: to, epoch, .. }) => {
                Ok(Err(Retry::Layout(format!("server {owner} says block {block} moved to {to} at epoch {epoch}"))))
            }
            Message::Error(e) if e.code == ErrorCode::NotReady => {
                Ok(Err(Retry::Later(format!("server {owner}: {}", e.message))))
            }
            Message::Error(e) => {
                bail!("server {owner} at {addr} refused to export block {block}: {} ({:?})", e.message, e.code)
            }
            other => bail!("server {owner} at {addr} answered ExportBlock of block {block} with {other:?}"),
        }
    }

    /// Sends `msg` to server `id` (connecting first if needed) and waits for its reply.
    async fn call(&mut self, id: ServerId, addr: &str, request_id: u64, msg: Message) -> anyhow::Result<Message> {
        if self.conns.get(&id).is_none_or(|(a, _, _)| a != addr) {
            let (reader, out) =
                elasticps_runtime::conn::connect(addr, self.codec.clone(), format!("server {id}")).await?;
            self.conns.insert(id, (addr.to_string(), reader, out));
        }
        let Some((_, reader, out)) = self.conns.get_mut(&id) else { bail!("no connection to server {id}") };
        out.send_all_now(vec![(request_id, msg)]).await?;
        let what = format!("server {id} at {addr} to answer ExportBlock (request {request_id})");
        elasticps_runtime::timeout(PAGE_TIMEOUT, what, async {
            loop {
                match reader.next().await? {
                    None => return Err(RuntimeError::Closed(format!("server {id} at {addr}"))),
                    Some((h, m)) if h.request_id == request_id => return Ok(m),
                    // A notification or a late reply: not this call's.
                    Some(_) => continue,
                }
            }
        })
        .await
        .map_err(Into::into)
    }
}

/// One page of an `ExportedBlock`.
struct Page {
    steps: u64,
    ids: Vec<u64>,
    values: Vec<f32>,
    deleted: Vec<u64>,
    more: bool,
}

/// The live blocks of `b`'s table in `partition` whose ranges lie within `b`'s.
fn halves_of(partition: &Partition, b: &BlockSpec) -> Vec<BlockSpec> {
    let (start, end, _) = b.row_range().unwrap_or_default();
    partition
        .table_blocks(b.tensor)
        .into_iter()
        .filter(|h| h.row_range().is_some_and(|(s, e, _)| start <= s && e <= end))
        .copied()
        .collect()
}

// Paces a retry of a migrating block (a rule of this tool, not of a node), so clippy.toml's
// ban on sleeps does not apply.
#[allow(clippy::disallowed_methods)]
async fn pause() {
    tokio::time::sleep(RETRY_PAUSE).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(block: BlockId, start: u64, end: u64, steps: u64) -> ShardEntry {
        let f = String::new();
        ShardEntry { block, start, end, steps, rows: 0, ids: f.clone(), values: f.clone(), deleted: f }
    }

    #[test]
    fn a_blocks_since_is_its_own_steps_or_the_block_it_was_split_from() {
        let prev = TableEntry {
            name: "emb".into(),
            dim: 2,
            hashed: true,
            shards: vec![shard(1, 0, 10, 7), shard(2, 10, 20, 3)],
        };
        let block = |id, s, e| BlockSpec::keys(id, 0, s, e, 2);
        assert_eq!(since_of(&prev, &block(1, 0, 10)), Some(7));
        assert_eq!(since_of(&prev, &block(5, 10, 15)), Some(3), "a half of block 2");
        assert_eq!(since_of(&prev, &block(6, 15, 20)), Some(3));
        assert_eq!(since_of(&prev, &block(9, 5, 15)), Some(3), "overlapping two: the older");
        assert_eq!(since_of(&prev, &block(9, 20, 30)), None, "rows the previous export did not cover");
    }

    #[test]
    fn the_parent_is_written_relative_to_the_export() {
        assert_eq!(relative_to(Path::new("/x/exports/full"), Path::new("/x/exports/d1")), "../full");
        assert_eq!(relative_to(Path::new("/x/a/./b/../full"), Path::new("/x/a/d1")), "../full");
        assert_eq!(relative_to(Path::new("/x/full"), Path::new("/x/full/sub")), "..");
    }
}
