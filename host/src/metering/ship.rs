//! Ships the spool's durable records to an object store, in batches, at
//! least once.
//!
//! Each batch is one object, `<prefix>/<spool id>/<segment>-<offset>.jsonl`,
//! named by where it starts in the spool. The spool id is made once per
//! spool directory and kept in it, so after a crash the shipper resends
//! from its last acknowledged position under the same names: a batch sent
//! before the crash but not acknowledged is overwritten by one that starts
//! at the same place (a superset of it, up to the new durable end), and a
//! record shipped twice keeps its record id, for deduplication downstream.
//!
//! The acknowledged position is the `cursor` file (`segment offset`),
//! replaced atomically once a put has succeeded. Segments shipped whole are
//! deleted. While the store is unreachable the records wait in the spool
//! (metric `pagoda_usage_log_spooled_bytes`) and the shipper retries every
//! flush interval.

use super::spool::{self, Position};
use anyhow::{Context, Result};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;

/// The largest batch object, in bytes.
pub const MAX_BATCH: u64 = 4 << 20;

/// Metric names.
pub mod metrics {
    /// Batches of usage records put to the store.
    pub const BATCHES: &str = "pagoda_usage_log_batches_shipped_total";
    /// Puts of a batch that failed (the batch stays spooled and is retried).
    pub const ERRORS: &str = "pagoda_usage_log_ship_errors_total";
    /// Bytes of records durable in the spool and not yet acknowledged by
    /// the store.
    pub const SPOOLED: &str = "pagoda_usage_log_spooled_bytes";
}

/// Sends a spool directory's records to a store.
pub struct Shipper {
    dir: PathBuf,
    store: Arc<dyn ObjectStore>,
    /// `<prefix>/<spool id>`.
    base: ObjectPath,
    durable: watch::Receiver<Position>,
    cursor: Position,
}

/// The spool's id: made once (random) and kept in `dir/spool-id`.
fn spool_id(dir: &Path) -> Result<String> {
    let path = dir.join("spool-id");
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    let id = format!("{:016x}", rand::random::<u64>());
    write_atomic(dir, "spool-id", id.as_bytes())?;
    Ok(id)
}

fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(name))
        .with_context(|| format!("replacing {}", dir.join(name).display()))?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

fn read_cursor(dir: &Path) -> Result<Position> {
    let path = dir.join("cursor");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Position::default()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mut parts = text.split_whitespace().map(str::parse::<u64>);
    match (parts.next(), parts.next()) {
        (Some(Ok(segment)), Some(Ok(offset))) => Ok(Position { segment, offset }),
        _ => anyhow::bail!(
            "{} is not 'SEGMENT OFFSET': delete it to resend the whole spool (records keep their ids)",
            path.display()
        ),
    }
}

impl Shipper {
    /// A shipper of `dir` (the spool's directory, already opened by its
    /// writer) to `base` in `store`.
    pub fn new(
        dir: PathBuf,
        store: Arc<dyn ObjectStore>,
        prefix: &ObjectPath,
        durable: watch::Receiver<Position>,
    ) -> Result<Shipper> {
        let id = spool_id(&dir)?;
        let cursor = read_cursor(&dir)?;
        let base = prefix.clone().join(id.as_str());
        Ok(Shipper {
            dir,
            store,
            base,
            durable,
            cursor,
        })
    }

    /// Where the batch starting at `at` goes.
    fn object(&self, at: Position) -> ObjectPath {
        self.base
            .clone()
            .join(format!("{:010}-{:012}.jsonl", at.segment, at.offset))
    }

    /// Ships everything durable now; stops at the first failed put (the
    /// rest waits for the next call). Returns the batches put.
    pub async fn ship(&mut self) -> Result<usize> {
        let durable = *self.durable.borrow();
        let mut shipped = 0;
        let segments = spool::segments(&self.dir)?;
        let mut spooled = 0u64;
        let from = self.cursor.segment;
        for &seg in segments.iter().filter(|&&s| s >= from) {
            if seg > self.cursor.segment {
                self.cursor = Position {
                    segment: seg,
                    offset: 0,
                };
            }
            let path = self.dir.join(spool::segment_name(seg));
            let mut f = std::fs::File::open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            // The current segment is shipped up to its durable end; one
            // before it is complete up to its last newline (a crash may
            // have torn what follows, which no response waited on).
            let end = if seg == durable.segment {
                durable.offset
            } else {
                let len = f.metadata()?.len();
                spool::complete_len(&mut f, len)?
            };
            while self.cursor.offset < end {
                let start = self.cursor.offset;
                let want = (end - start).min(MAX_BATCH);
                let mut buf = vec![0u8; want as usize];
                f.seek(SeekFrom::Start(start))?;
                f.read_exact(&mut buf)
                    .with_context(|| format!("reading {}", path.display()))?;
                // Whole lines only (a batch cut at MAX_BATCH ends at a
                // newline; a line longer than a batch goes whole).
                let cut = match buf.iter().rposition(|&b| b == b'\n') {
                    Some(i) => i + 1,
                    None => {
                        let len = (end - start) as usize;
                        buf.resize(len, 0);
                        f.seek(SeekFrom::Start(start))?;
                        f.read_exact(&mut buf)?;
                        match buf.iter().position(|&b| b == b'\n') {
                            Some(i) => i + 1,
                            None => break,
                        }
                    }
                };
                buf.truncate(cut);
                let at = self.cursor;
                let object = self.object(at);
                if let Err(e) = self.store.put(&object, PutPayload::from(buf)).await {
                    ::metrics::counter!(metrics::ERRORS).increment(1);
                    ::metrics::gauge!(metrics::SPOOLED).set((end - start + spooled) as f64);
                    return Err(e).with_context(|| format!("putting usage records to {object}"));
                }
                ::metrics::counter!(metrics::BATCHES).increment(1);
                shipped += 1;
                self.cursor.offset = start + cut as u64;
                write_atomic(
                    &self.dir,
                    "cursor",
                    format!("{} {}", self.cursor.segment, self.cursor.offset).as_bytes(),
                )?;
            }
            if seg < durable.segment && self.cursor.offset >= end {
                // Shipped whole, and no writer will add to it again.
                std::fs::remove_file(&path)
                    .with_context(|| format!("removing shipped {}", path.display()))?;
            } else {
                spooled += end.saturating_sub(self.cursor.offset);
            }
        }
        ::metrics::gauge!(metrics::SPOOLED).set(spooled as f64);
        Ok(shipped)
    }

    /// Ships every `every` until `stop` says so, then once more.
    pub async fn run(mut self, every: std::time::Duration, mut stop: watch::Receiver<bool>) {
        loop {
            let stopping = tokio::select! {
                _ = tokio::time::sleep(every) => false,
                _ = stop.changed() => true,
            };
            if let Err(e) = self.ship().await {
                tracing::warn!("usage log: {e:#}; the records stay spooled and are retried");
            }
            if stopping || *stop.borrow() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metering::spool::{Layout, Spool};
    use futures_util::TryStreamExt;

    async fn objects(store: &Arc<dyn ObjectStore>) -> Vec<(String, String)> {
        let metas: Vec<_> = store.list(None).try_collect().await.expect("list");
        let mut out = Vec::new();
        for m in metas {
            let bytes = store
                .get(&m.location)
                .await
                .expect("get")
                .bytes()
                .await
                .expect("bytes");
            out.push((
                m.location.to_string(),
                String::from_utf8(bytes.to_vec()).expect("utf8"),
            ));
        }
        out.sort();
        out
    }

    fn lines(objects: &[(String, String)]) -> Vec<String> {
        objects
            .iter()
            .flat_map(|(_, t)| t.lines().map(str::to_string))
            .collect()
    }

    #[tokio::test]
    async fn durable_records_reach_the_store_and_shipped_segments_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spool_dir = dir.path().join("spool");
        let store_dir = dir.path().join("store");
        std::fs::create_dir_all(&store_dir).expect("mkdir");
        let store: Arc<dyn ObjectStore> = Arc::new(
            object_store::local::LocalFileSystem::new_with_prefix(&store_dir).expect("store"),
        );
        // A segment left by an earlier run, torn at its end.
        std::fs::create_dir_all(&spool_dir).expect("mkdir");
        std::fs::write(
            spool_dir.join(spool::segment_name(3)),
            "{\"n\":0}\n{\"n\":1}\n{\"n\"",
        )
        .expect("write");
        let spool = Spool::open(Layout::Segments(spool_dir.clone())).expect("open");
        spool.commit(b"{\"n\":2}".to_vec()).await.expect("commit");
        let mut s = Shipper::new(
            spool_dir.clone(),
            Arc::clone(&store),
            &ObjectPath::from("usage"),
            spool.durable(),
        )
        .expect("shipper");
        assert_eq!(s.ship().await.expect("ship"), 2);
        let got = objects(&store).await;
        assert_eq!(lines(&got), ["{\"n\":0}", "{\"n\":1}", "{\"n\":2}"]);
        assert!(got[0].0.starts_with("usage/"), "{got:?}");
        // The old segment went; the current one stays for more records.
        assert_eq!(spool::segments(&spool_dir).expect("segments"), vec![4]);
        // Nothing new: nothing put.
        assert_eq!(s.ship().await.expect("ship"), 0);
        spool.commit(b"{\"n\":3}".to_vec()).await.expect("commit");
        assert_eq!(s.ship().await.expect("ship"), 1);
        let got = objects(&store).await;
        assert_eq!(
            lines(&got),
            ["{\"n\":0}", "{\"n\":1}", "{\"n\":2}", "{\"n\":3}"]
        );
    }

    #[tokio::test]
    async fn after_a_crash_unacknowledged_batches_are_resent_under_the_same_names() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spool_dir = dir.path().join("spool");
        let store_dir = dir.path().join("store");
        std::fs::create_dir_all(&store_dir).expect("mkdir");
        let store: Arc<dyn ObjectStore> = Arc::new(
            object_store::local::LocalFileSystem::new_with_prefix(&store_dir).expect("store"),
        );
        let spool = Spool::open(Layout::Segments(spool_dir.clone())).expect("open");
        spool.commit(b"{\"n\":0}".to_vec()).await.expect("commit");
        let mut s = Shipper::new(
            spool_dir.clone(),
            Arc::clone(&store),
            &ObjectPath::default(),
            spool.durable(),
        )
        .expect("shipper");
        s.ship().await.expect("ship");
        // The put of the next batch lands, then the process dies before
        // its cursor is written: the cursor file still says the old place.
        let acked = std::fs::read_to_string(spool_dir.join("cursor")).expect("cursor");
        spool.commit(b"{\"n\":1}".to_vec()).await.expect("commit");
        s.ship().await.expect("ship");
        std::fs::write(spool_dir.join("cursor"), acked).expect("rewind");
        drop(s);
        spool.commit(b"{\"n\":2}".to_vec()).await.expect("commit");
        let mut s = Shipper::new(
            spool_dir.clone(),
            Arc::clone(&store),
            &ObjectPath::default(),
            spool.durable(),
        )
        .expect("shipper");
        s.ship().await.expect("ship");
        let got = objects(&store).await;
        // Two objects: the first batch, and the resent one starting where
        // the lost acknowledgement left off, now with the later record.
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(lines(&got), ["{\"n\":0}", "{\"n\":1}", "{\"n\":2}"]);
    }
}
