//! Durable appends of usage records: each record is on disk (written and
//! `fdatasync`ed) before its request's response goes out.
//!
//! One writer thread takes records from every request and commits them in
//! groups: whatever arrived while the last `fdatasync` ran is written and
//! synced together, so a busy server pays one sync per group, not per
//! request, and no request waits for more than about two syncs.
//!
//! Two layouts:
//! - [`Layout::File`]: the usage log itself, one JSON line per record (a
//!   local `--usage-log PATH`). A crash can leave half a line at the end
//!   (a group whose sync never returned, so no response waited on it); it
//!   is cut off when the file is opened again.
//! - [`Layout::Segments`]: a spool directory for an object store
//!   destination: numbered segment files (`0000000042.jsonl`), a new one at
//!   each start and whenever one passes [`SEGMENT_BYTES`]. The
//!   [shipper](super::ship) sends what is durable and deletes segments it
//!   has shipped whole. The writer publishes the durable end of the current
//!   segment; earlier segments are complete up to their last newline.

use anyhow::{bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use tokio::sync::{oneshot, watch};

/// A segment is closed and a new one opened past this many bytes.
pub const SEGMENT_BYTES: u64 = 8 << 20;

/// The most records one group commit takes.
const MAX_GROUP: usize = 4096;

/// Where records go.
#[derive(Clone, Debug)]
pub enum Layout {
    /// Appended to this file.
    File(PathBuf),
    /// Segment files in this directory, for the shipper.
    Segments(PathBuf),
}

/// How far the records are durable: the current segment and the byte
/// offset in it up to which every line is synced. (In the file layout the
/// segment is always 0.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub segment: u64,
    pub offset: u64,
}

struct Append {
    line: Vec<u8>,
    /// Told once the line is synced (or could not be written).
    done: Option<oneshot::Sender<Result<(), String>>>,
}

/// The handle requests append through; the writer thread stops when the
/// last handle is dropped.
pub struct Spool {
    tx: mpsc::Sender<Append>,
    durable: watch::Receiver<Position>,
}

/// The name of segment `n`.
pub fn segment_name(n: u64) -> String {
    format!("{n:010}.jsonl")
}

/// The segment numbers in `dir`, in order.
pub fn segments(dir: &Path) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e.with_context(|| format!("reading {}", dir.display()))?;
        let name = e.file_name();
        let Some(n) = name
            .to_str()
            .and_then(|s| s.strip_suffix(".jsonl"))
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        out.push(n);
    }
    out.sort_unstable();
    Ok(out)
}

fn open_append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot open {} for appending", path.display()))
}

/// Cuts `f` after its last newline: what follows is the torn end of a
/// group whose sync never returned. Returns the length kept.
fn cut_torn_tail(f: &mut File, path: &Path) -> Result<u64> {
    let len = f.metadata()?.len();
    let keep = complete_len(f, len).with_context(|| format!("reading {}", path.display()))?;
    if keep < len {
        f.set_len(keep)
            .with_context(|| format!("cutting the torn end off {}", path.display()))?;
        f.sync_data()?;
        tracing::warn!(
            "{}: dropped {} bytes of a record cut short by a crash (no response waited on it)",
            path.display(),
            len - keep
        );
    }
    Ok(keep)
}

/// The length of `f`'s first `len` bytes up to and with the last newline.
pub fn complete_len(f: &mut File, len: u64) -> std::io::Result<u64> {
    let mut end = len;
    let mut buf = vec![0u8; 64 << 10];
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let n = (end - start) as usize;
        f.seek(SeekFrom::Start(start))?;
        f.read_exact(&mut buf[..n])?;
        if let Some(i) = buf[..n].iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Spool {
    /// Opens the log or spool and starts its writer. In the segment
    /// layout the directory is created (0700), locked against a second
    /// process, and a new segment begun after the highest there.
    pub fn open(layout: Layout) -> Result<Spool> {
        let (file, path, segment, lock) = match &layout {
            Layout::File(path) => {
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    crate::tenants::store::create_private_dir(dir)
                        .with_context(|| format!("cannot create {}", dir.display()))?;
                }
                let mut f = open_append(path)?;
                let lock = f.try_lock().is_ok();
                if !lock {
                    bail!(
                        "{} is in use by another process: give each server its own --usage-log",
                        path.display()
                    );
                }
                cut_torn_tail(&mut f, path)?;
                (f, path.clone(), 0, None)
            }
            Layout::Segments(dir) => {
                crate::tenants::store::create_private_dir(dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
                let lock = OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .mode(0o600)
                    .open(dir.join("lock"))
                    .with_context(|| format!("cannot open {}/lock", dir.display()))?;
                if lock.try_lock().is_err() {
                    bail!(
                        "the usage spool {} is in use by another process: give each server its own --usage-log-spool",
                        dir.display()
                    );
                }
                let next = segments(dir)?.last().map_or(0, |n| n + 1);
                let path = dir.join(segment_name(next));
                let f = open_append(&path)?;
                sync_dir(dir).with_context(|| format!("syncing {}", dir.display()))?;
                (f, path, next, Some(lock))
            }
        };
        let offset = file.metadata()?.len();
        let (durable_tx, durable) = watch::channel(Position { segment, offset });
        let (tx, rx) = mpsc::channel::<Append>();
        let writer = Writer {
            layout,
            file,
            path,
            pos: Position { segment, offset },
            durable: durable_tx,
            _lock: lock,
        };
        std::thread::Builder::new()
            .name("usage-log".into())
            .spawn(move || writer.run(rx))
            .context("starting the usage log's writer thread")?;
        Ok(Spool { tx, durable })
    }

    /// Appends `line` (one JSON object, no newline) and waits until it is
    /// synced to disk.
    pub async fn commit(&self, line: Vec<u8>) -> Result<(), String> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send(Append {
                line,
                done: Some(done),
            })
            .map_err(|_| "the usage log's writer has stopped".to_string())?;
        wait.await
            .map_err(|_| "the usage log's writer has stopped".to_string())?
    }

    /// Appends `line` without waiting (a record no response waits on).
    pub fn submit(&self, line: Vec<u8>) {
        let _ = self.tx.send(Append { line, done: None });
    }

    /// Follows the durable end of the current segment.
    pub fn durable(&self) -> watch::Receiver<Position> {
        self.durable.clone()
    }
}

struct Writer {
    layout: Layout,
    file: File,
    path: PathBuf,
    pos: Position,
    durable: watch::Sender<Position>,
    /// Held for the process's life: one writer per spool.
    _lock: Option<File>,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Append>) {
        let mut buf = Vec::new();
        while let Ok(first) = rx.recv() {
            let mut group = vec![first];
            while group.len() < MAX_GROUP {
                match rx.try_recv() {
                    Ok(a) => group.push(a),
                    Err(_) => break,
                }
            }
            buf.clear();
            for a in &group {
                buf.extend_from_slice(&a.line);
                buf.push(b'\n');
            }
            let result = self.write(&buf);
            if let Err(e) = &result {
                tracing::error!("usage log {}: {e:#}", self.path.display());
            }
            let result = result.map_err(|e| format!("{e:#}"));
            for a in group {
                if let Some(d) = a.done {
                    let _ = d.send(result.clone());
                }
            }
        }
    }

    fn write(&mut self, buf: &[u8]) -> Result<()> {
        let r = self
            .file
            .write_all(buf)
            .and_then(|()| self.file.sync_data());
        if let Err(e) = r {
            // Leave no part of a failed group behind: a later group must
            // not follow half a line.
            let _ = self.file.set_len(self.pos.offset);
            return Err(e).with_context(|| format!("appending to {}", self.path.display()));
        }
        self.pos.offset += buf.len() as u64;
        self.durable.send_replace(self.pos);
        if let Layout::Segments(dir) = &self.layout {
            if self.pos.offset >= SEGMENT_BYTES {
                let next = self.pos.segment + 1;
                let path = dir.join(segment_name(next));
                let f = open_append(&path)?;
                sync_dir(dir).with_context(|| format!("syncing {}", dir.display()))?;
                self.file = f;
                self.path = path;
                self.pos = Position {
                    segment: next,
                    offset: 0,
                };
                self.durable.send_replace(self.pos);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    }

    #[test]
    fn committed_lines_are_in_the_file_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("logs/usage.jsonl");
        let spool = Spool::open(Layout::File(path.clone())).expect("open");
        runtime().block_on(async {
            for i in 0..5 {
                spool
                    .commit(format!("{{\"n\":{i}}}").into_bytes())
                    .await
                    .expect("commit");
            }
        });
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(
            text,
            "{\"n\":0}\n{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n{\"n\":4}\n"
        );
    }

    #[test]
    fn a_torn_last_line_is_cut_when_the_log_is_opened_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("usage.jsonl");
        std::fs::write(&path, "{\"n\":0}\n{\"n\":1}\n{\"n\":").expect("write");
        let spool = Spool::open(Layout::File(path.clone())).expect("open");
        runtime()
            .block_on(spool.commit(b"{\"n\":2}".to_vec()))
            .expect("commit");
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(text, "{\"n\":0}\n{\"n\":1}\n{\"n\":2}\n");
    }

    #[test]
    fn a_second_writer_of_the_same_log_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("usage.jsonl");
        let _first = Spool::open(Layout::File(path.clone())).expect("open");
        let second = Spool::open(Layout::File(path)).err().expect("refused");
        assert!(format!("{second:#}").contains("in use by another process"));
        let spool = dir.path().join("spool");
        let _first = Spool::open(Layout::Segments(spool.clone())).expect("open");
        assert!(Spool::open(Layout::Segments(spool)).is_err());
    }

    #[test]
    fn each_start_begins_a_new_segment_and_publishes_its_durable_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spool_dir = dir.path().join("spool");
        {
            let spool = Spool::open(Layout::Segments(spool_dir.clone())).expect("open");
            runtime()
                .block_on(spool.commit(b"{}".to_vec()))
                .expect("commit");
            assert_eq!(
                *spool.durable().borrow(),
                Position {
                    segment: 0,
                    offset: 3
                }
            );
        }
        // The writer thread lets go of the lock once its handle is gone.
        let mut reopened = None;
        for _ in 0..100 {
            match Spool::open(Layout::Segments(spool_dir.clone())) {
                Ok(s) => {
                    reopened = Some(s);
                    break;
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
        let spool = reopened.expect("reopened");
        assert_eq!(spool.durable().borrow().segment, 1);
        assert_eq!(segments(&spool_dir).expect("segments"), vec![0, 1]);
    }
}
