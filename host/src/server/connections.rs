//! Taking connections without letting clients exhaust the server.
//!
//! Every open connection costs a file descriptor, and a process has a fixed
//! number of them. So:
//! - at most [`ConnectionLimits::max_connections`] connections are served
//!   normally at once; beyond that, a small overflow pool answers health
//!   probes and `/metrics` at once (so Kubernetes still sees the server
//!   alive), and lets other requests wait up to [`SLOT_WAIT`], in order of
//!   arrival, for a normal slot (answering 503 when none comes), closing
//!   each connection after one request; part of the pool is kept for the
//!   probes ([`OVERFLOW_WAITERS`] may wait at most); past the overflow
//!   pool, a connection is accepted and closed at once, which frees its
//!   descriptor instead of leaving it in the kernel's backlog;
//! - a client must send a request's head within
//!   [`ConnectionLimits::header_timeout`] (idle keep-alive connections
//!   included) and its body within [`BODY_TIMEOUT`], so idle and slow
//!   clients give their slots back;
//! - when every normal slot is taken, a new connection (or a request
//!   waiting in the overflow pool) evicts the connection that has been
//!   stalled longest: an idle keep-alive connection or one still dribbling
//!   its request head, as slowloris clients do, once it has been so for
//!   [`EVICT_AFTER_IDLE`]; or one whose request body has brought fewer than
//!   [`BODY_PROGRESS_BYTES`] in the last [`BODY_STALL`] (a client that
//!   sends its body promptly never is). Connections serving a request
//!   whose body has arrived are never evicted, so slow and idle clients
//!   cannot hold every slot against normal requests, whatever the
//!   descriptor limit (nginx and Envoy do the same under pressure). The
//!   evicted connection's slot passes to the new one at once: the accept
//!   loop never waits;
//! - when `accept` fails for lack of descriptors or memory, the loop backs
//!   off (up to a second) instead of spinning, and logs that at most once
//!   every few seconds, with a count;
//! - every connection refused or cut short is counted in
//!   [`REFUSED_METRIC`], by [`Refusal`] reason, and reported in a warning
//!   at most once every [`REPORT_EVERY`], with counts.

use bytes::Buf;
use futures_util::task::AtomicWaker;
use hyper::body::{Body, Frame, SizeHint};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long a connection must have gone without a request in progress
/// before a new connection may evict it. A client that has just connected
/// sends its request head well within this.
pub const EVICT_AFTER_IDLE: Duration = Duration::from_millis(500);

/// How long a request body may bring fewer than [`BODY_PROGRESS_BYTES`]
/// before its connection may be evicted under pressure, as long as a slow
/// head may take (a body trickling in at less than about 2 KiB/s; a client
/// that sends its body with its head is done long before).
pub const BODY_STALL: Duration = EVICT_AFTER_IDLE;

/// How much of a body must arrive within [`BODY_STALL`] for the body to
/// count as making progress.
pub const BODY_PROGRESS_BYTES: u64 = 1024;

/// How long a client may take to send a request's body, pressure or not
/// (then 408). Request bodies here are JSON and plugin uploads that a
/// client has in hand when it starts sending them.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections beyond the normal slots that may still be answered (health
/// probes, and requests waiting for a normal slot), each for one request.
const OVERFLOW_SLOTS: usize = 64;

/// How many overflow connections may wait for a normal slot at once; the
/// rest of the pool is kept for probes, which never wait.
pub const OVERFLOW_WAITERS: usize = OVERFLOW_SLOTS - 16;

/// How long a request on an overflow connection waits for a normal slot
/// before it is answered 503.
pub const SLOT_WAIT: Duration = Duration::from_secs(5);

/// Evicted connections that may still be closing, per listener: each
/// holds its descriptor until its task notices, which is at once unless the
/// runtime is swamped; past this, nothing more is evicted until they have.
const MAX_EVICTING: usize = 32;

/// How long an overflow connection may take to send its request's head.
const OVERFLOW_HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// Descriptors kept for everything that is not a client connection: the
/// model files, plugin artifacts, the state directory, logs.
const RESERVED_FDS: u64 = 128;

/// The most connections served normally by default, however many
/// descriptors the process may open.
const DEFAULT_MAX_CONNECTIONS: usize = 16_384;

/// Connections refused or cut short, by `reason` (see [`Refusal`]).
pub const REFUSED_METRIC: &str = "pagoda_http_connections_refused_total";

/// How often at most refusals are reported in the log.
pub const REPORT_EVERY: Duration = Duration::from_secs(5);

/// Why a connection was refused or cut short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A request on an overflow connection found no normal slot within
    /// [`SLOT_WAIT`] (or too many were waiting already): answered 503.
    Overflow503,
    /// Both pools were full: closed as soon as accepted.
    ClosedAtAccept,
    /// Evicted under pressure: idle between requests, or still sending its
    /// request head.
    EvictedIdle,
    /// Evicted under pressure: its request body stalled.
    EvictedSlowBody,
    /// Closed: a request head started but did not arrive within the header
    /// timeout (or a new connection sent none). Idle keep-alive
    /// connections closed by the same timer are routine and not counted.
    HeaderTimeout,
    /// Answered 408: a request body did not arrive within [`BODY_TIMEOUT`].
    BodyTimeout,
    /// `accept` failed for lack of descriptors or memory (the connection
    /// waits in the kernel's backlog).
    AcceptFailed,
}

impl Refusal {
    /// Every reason, in the order of their indices.
    pub const ALL: [Refusal; 7] = [
        Refusal::Overflow503,
        Refusal::ClosedAtAccept,
        Refusal::EvictedIdle,
        Refusal::EvictedSlowBody,
        Refusal::HeaderTimeout,
        Refusal::BodyTimeout,
        Refusal::AcceptFailed,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Overflow503 => "overflow_503",
            Refusal::ClosedAtAccept => "closed_at_accept",
            Refusal::EvictedIdle => "evicted_idle",
            Refusal::EvictedSlowBody => "evicted_slow_body",
            Refusal::HeaderTimeout => "header_timeout",
            Refusal::BodyTimeout => "body_timeout",
            Refusal::AcceptFailed => "accept_failed",
        }
    }
}

/// Refusals not yet reported in the log, by reason.
static UNREPORTED: [AtomicU64; Refusal::ALL.len()] =
    [const { AtomicU64::new(0) }; Refusal::ALL.len()];

/// When refusals were last reported.
static LAST_REPORT: Mutex<Option<Instant>> = Mutex::new(None);

/// Describes [`REFUSED_METRIC`] and starts every reason at zero, so that
/// the series exist before the first refusal.
pub fn describe_metrics() {
    metrics::describe_counter!(
        REFUSED_METRIC,
        "Connections refused or cut short to protect the server (503 from the overflow pool, closed at accept, evicted under pressure, header or body timeout, failed accept), by reason."
    );
    for r in Refusal::ALL {
        metrics::counter!(REFUSED_METRIC, "reason" => r.label()).absolute(0);
    }
}

/// Counts a connection refused or cut short, and reports the refusals
/// counted since the last report, at most once every [`REPORT_EVERY`].
pub fn refused(r: Refusal) {
    metrics::counter!(REFUSED_METRIC, "reason" => r.label()).increment(1);
    if r == Refusal::AcceptFailed {
        // Reported by the accept loop, with its error.
        return;
    }
    UNREPORTED[r as usize].fetch_add(1, Ordering::Relaxed);
    let now = Instant::now();
    let since = {
        let mut last = LAST_REPORT.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| now.duration_since(t) < REPORT_EVERY) {
            return;
        }
        last.replace(now)
    };
    let mut total = 0;
    let counts: Vec<String> = Refusal::ALL
        .iter()
        .filter_map(|r| {
            let n = UNREPORTED[*r as usize].swap(0, Ordering::Relaxed);
            total += n;
            (n > 0).then(|| format!("{} {n}", r.label()))
        })
        .collect();
    if total == 0 {
        return;
    }
    let when = match since {
        Some(t) => format!(" in the last {} s", now.duration_since(t).as_secs()),
        None => String::new(),
    };
    tracing::warn!(
        "{total} connections refused or cut short{when} ({}; see {REFUSED_METRIC}): clients are holding connections open or arriving faster than they are served. If normal clients are among them, raise the open-files limit (ulimit -n) or --max-connections.",
        counts.join(", ")
    );
}

/// How the server takes connections.
#[derive(Clone, Debug)]
pub struct ConnectionLimits {
    /// Connections served at once; `None`: from the descriptor limit.
    pub max_connections: Option<usize>,
    /// How long a client may take to send a request's head.
    pub header_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: None,
            header_timeout: Duration::from_secs(10),
        }
    }
}

/// Raises the soft limit on open files to the hard limit (servers need
/// many; the soft default is often 1024) and returns the limit in effect.
pub fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit with a valid, initialized struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    lim.rlim_cur
}

/// The normal connection slots for a process that may open `fd_limit`
/// descriptors: all but [`RESERVED_FDS`] and the overflow pool, at most
/// [`DEFAULT_MAX_CONNECTIONS`], at least 16.
pub fn default_max_connections(fd_limit: u64) -> usize {
    let usable = fd_limit.saturating_sub(RESERVED_FDS + OVERFLOW_SLOTS as u64);
    (usable.min(DEFAULT_MAX_CONNECTIONS as u64) as usize).max(16)
}

/// A connection taken, and how it may be served.
pub struct Accepted {
    /// The socket, whose reads fail once the connection is evicted.
    pub stream: EvictableIo<TcpStream>,
    /// Served from the overflow pool: probes at once, other requests once
    /// a normal slot is free; one request.
    pub overflow: bool,
    /// Its entry among the open connections, which holds its slot: keep it
    /// for as long as the connection is open.
    pub conn: ConnHandle,
}

/// What a connection's socket, its requests and the registry share.
#[derive(Default)]
struct Shared {
    /// Evicted: its reads fail from then on, which ends the connection
    /// (and frees its descriptor) even while it waits for a request head.
    evicted: AtomicBool,
    waker: AtomicWaker,
    /// A request is in progress: its head has arrived, its response has
    /// not been sent.
    in_request: AtomicBool,
    /// Idle after a request, no byte of the next one yet: the header
    /// timeout closing it then is routine, not a refusal.
    kept_alive: AtomicBool,
    /// While a request body is read: since when it has made progress.
    body: Mutex<Option<BodyProgress>>,
}

impl Shared {
    fn body(&self) -> MutexGuard<'_, Option<BodyProgress>> {
        self.body.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A request body being read.
#[derive(Clone, Copy, Debug)]
struct BodyProgress {
    /// When it last brought [`BODY_PROGRESS_BYTES`] (or began).
    mark: Instant,
    /// Bytes since.
    bytes: u64,
}

impl BodyProgress {
    fn advance(&mut self, n: u64, now: Instant) {
        self.bytes = self.bytes.saturating_add(n);
        if self.bytes >= BODY_PROGRESS_BYTES {
            self.mark = now;
            self.bytes = 0;
        }
    }
}

/// Which pool a connection's slot is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pool {
    Main,
    Overflow,
}

/// One open connection's standing.
struct ConnState {
    pool: Pool,
    /// Its slot; taken by the connection that evicts it.
    slot: Option<OwnedSemaphorePermit>,
    /// Requests in progress (until their response has been sent).
    requests: usize,
    /// Since when none has been.
    idle_since: Instant,
    shared: Arc<Shared>,
}

impl ConnState {
    /// When the connection may be (or became) evicted, and as what; `None`
    /// while it may not be (serving a request whose body has arrived, or
    /// evicted already).
    fn evictable_at(&self) -> Option<(Instant, Refusal)> {
        if self.shared.evicted.load(Ordering::Acquire) {
            return None;
        }
        if self.requests == 0 {
            return Some((self.idle_since + EVICT_AFTER_IDLE, Refusal::EvictedIdle));
        }
        let body = *self.shared.body();
        body.map(|b| (b.mark + BODY_STALL, Refusal::EvictedSlowBody))
    }
}

/// The connection of `pool` to evict at `now`: the one evictable the
/// longest. Otherwise, when the first will be evictable, if any may be.
fn choose_victim<'a>(
    conns: impl Iterator<Item = (&'a u64, &'a ConnState)>,
    pool: Pool,
    now: Instant,
) -> Result<(u64, Refusal), Option<Instant>> {
    let first = conns
        .filter(|(_, c)| c.pool == pool && c.slot.is_some())
        .filter_map(|(id, c)| c.evictable_at().map(|(at, why)| (at, *id, why)))
        .min_by_key(|(at, id, _)| (*at, *id));
    match first {
        Some((at, id, why)) if at <= now => Ok((id, why)),
        Some((at, _, _)) => Err(Some(at)),
        None => Err(None),
    }
}

/// The open connections of one listener.
#[derive(Default)]
struct Conns {
    next_id: u64,
    map: HashMap<u64, ConnState>,
    /// Evicted connections not yet closed.
    evicting: usize,
}

/// One listener's slots and open connections.
struct Pools {
    main: Arc<Semaphore>,
    overflow: Arc<Semaphore>,
    conns: Mutex<Conns>,
    /// Overflow requests waiting for a normal slot.
    waiting: AtomicUsize,
}

#[derive(Clone)]
struct Registry(Arc<Pools>);

impl Registry {
    fn new(max_connections: usize) -> Registry {
        Registry(Arc::new(Pools {
            main: Arc::new(Semaphore::new(max_connections)),
            overflow: Arc::new(Semaphore::new(OVERFLOW_SLOTS)),
            conns: Mutex::default(),
            waiting: AtomicUsize::new(0),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, Conns> {
        self.0.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for a new connection, evicting a stalled one if need be;
    /// `None`: both pools are full of connections that may not be evicted.
    fn admit(&self) -> Option<(Pool, OwnedSemaphorePermit)> {
        if let Ok(p) = Arc::clone(&self.0.main).try_acquire_owned() {
            return Some((Pool::Main, p));
        }
        // Requests waiting in the overflow pool are first in line for the
        // slots that evictions free.
        let queued = self.0.waiting.load(Ordering::Acquire) > 0;
        if !queued {
            if let Ok(p) = self.evict(Pool::Main) {
                return Some((Pool::Main, p));
            }
        }
        if let Ok(p) = Arc::clone(&self.0.overflow).try_acquire_owned() {
            return Some((Pool::Overflow, p));
        }
        if let Ok(p) = self.evict(Pool::Overflow) {
            return Some((Pool::Overflow, p));
        }
        if queued {
            if let Ok(p) = self.evict(Pool::Main) {
                return Some((Pool::Main, p));
            }
        }
        None
    }

    fn register(&self, pool: Pool, slot: OwnedSemaphorePermit) -> ConnHandle {
        let shared = Arc::new(Shared::default());
        let mut g = self.lock();
        g.next_id += 1;
        let id = g.next_id;
        g.map.insert(
            id,
            ConnState {
                pool,
                slot: Some(slot),
                requests: 0,
                idle_since: Instant::now(),
                shared: Arc::clone(&shared),
            },
        );
        ConnHandle {
            registry: self.clone(),
            id,
            shared,
            overflow: pool == Pool::Overflow,
        }
    }

    /// Evicts the connection of `pool` stalled the longest and returns its
    /// slot; otherwise when one may next be evicted, if any may be.
    fn evict(&self, pool: Pool) -> Result<OwnedSemaphorePermit, Option<Instant>> {
        let (slot, why) = {
            let mut g = self.lock();
            if g.evicting >= MAX_EVICTING {
                return Err(None);
            }
            let (id, why) = choose_victim(g.map.iter(), pool, Instant::now())?;
            let Some(c) = g.map.get_mut(&id) else {
                return Err(None);
            };
            let Some(slot) = c.slot.take() else {
                return Err(None);
            };
            c.shared.evicted.store(true, Ordering::Release);
            c.shared.waker.wake();
            g.evicting += 1;
            (slot, why)
        };
        refused(why);
        Ok(slot)
    }

    /// Moves connection `id` to a normal slot, freeing its overflow one.
    fn promote(&self, id: u64, slot: OwnedSemaphorePermit) -> bool {
        let mut g = self.lock();
        match g.map.get_mut(&id) {
            Some(c) if !c.shared.evicted.load(Ordering::Acquire) => {
                c.pool = Pool::Main;
                c.slot = Some(slot);
                true
            }
            _ => false,
        }
    }
}

/// A connection's entry among the open connections, which holds its slot;
/// removed (and the slot freed) when dropped.
pub struct ConnHandle {
    registry: Registry,
    id: u64,
    shared: Arc<Shared>,
    overflow: bool,
}

impl ConnHandle {
    /// Marks a request in progress on the connection until the returned
    /// guard is dropped (when its response has been sent): meanwhile the
    /// connection is never evicted, except while its body stalls (see
    /// [`watch_body`]).
    pub fn request_started(&self) -> RequestGuard {
        if let Some(c) = self.registry.lock().map.get_mut(&self.id) {
            c.requests += 1;
        }
        self.shared.in_request.store(true, Ordering::Release);
        self.shared.kept_alive.store(false, Ordering::Release);
        RequestGuard {
            registry: self.registry.clone(),
            id: self.id,
            shared: Arc::clone(&self.shared),
        }
    }
}

impl Drop for ConnHandle {
    fn drop(&mut self) {
        let mut g = self.registry.lock();
        if let Some(c) = g.map.remove(&self.id) {
            if c.shared.evicted.load(Ordering::Acquire) {
                g.evicting = g.evicting.saturating_sub(1);
            }
        }
    }
}

/// A request in progress on a connection (see [`ConnHandle::request_started`]).
pub struct RequestGuard {
    registry: Registry,
    id: u64,
    shared: Arc<Shared>,
}

impl RequestGuard {
    /// What [`watch_body`] finds in the request's extensions, to track its
    /// body's progress.
    pub fn body_watch(&self) -> BodyWatch {
        BodyWatch(Arc::clone(&self.shared))
    }

    /// For a request on an overflow connection: waits up to [`SLOT_WAIT`]
    /// for a normal slot (in order of arrival, evicting stalled
    /// connections as they become evictable) and moves the connection to
    /// it. `false`: none came, or too many requests are waiting already;
    /// the caller answers 503, counted here as [`Refusal::Overflow503`].
    pub async fn wait_for_slot(&self) -> bool {
        let got = self.wait().await;
        if !got {
            refused(Refusal::Overflow503);
        }
        got
    }

    async fn wait(&self) -> bool {
        let pools = &self.registry.0;
        let admitted = pools
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < OVERFLOW_WAITERS).then_some(w + 1)
            })
            .is_ok();
        if !admitted {
            return false;
        }
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let _waiting = Waiting(&pools.waiting);
        let deadline = Instant::now() + SLOT_WAIT;
        // The semaphore serves its waiters in order: a slot freed by any
        // waiter's eviction goes to the first in line.
        let acquire = Arc::clone(&pools.main).acquire_owned();
        tokio::pin!(acquire);
        let mut wake = Instant::now();
        loop {
            tokio::select! {
                biased;
                slot = &mut acquire => {
                    return match slot {
                        Ok(slot) => self.registry.promote(self.id, slot),
                        Err(_) => false,
                    };
                }
                _ = tokio::time::sleep_until(wake.into()) => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            wake = match self.registry.evict(Pool::Main) {
                // Freed for the first in line; evict again later if that
                // was another.
                Ok(slot) => {
                    drop(slot);
                    now + Duration::from_millis(50)
                }
                Err(Some(at)) => at.clamp(
                    now + Duration::from_millis(10),
                    now + Duration::from_millis(250),
                ),
                Err(None) => now + Duration::from_millis(250),
            }
            .min(deadline);
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if let Some(c) = self.registry.lock().map.get_mut(&self.id) {
            c.requests = c.requests.saturating_sub(1);
            if c.requests == 0 {
                c.idle_since = Instant::now();
            }
        }
        *self.shared.body() = None;
        self.shared.in_request.store(false, Ordering::Release);
        self.shared.kept_alive.store(true, Ordering::Release);
    }
}

/// Put in a request's extensions (from [`RequestGuard::body_watch`]):
/// lets [`watch_body`] report the body's progress to the eviction policy.
#[derive(Clone)]
pub struct BodyWatch(Arc<Shared>);

/// The body of `req`, reporting its progress while it is read: a body that
/// stalls makes its connection evictable under pressure, like a slow head.
/// Requests without a [`BodyWatch`] are not tracked.
pub fn watch_body<B>(req: hyper::Request<B>) -> WatchedBody<B> {
    let shared = req
        .extensions()
        .get::<BodyWatch>()
        .map(|w| Arc::clone(&w.0));
    if let Some(s) = &shared {
        *s.body() = Some(BodyProgress {
            mark: Instant::now(),
            bytes: 0,
        });
    }
    WatchedBody {
        inner: req.into_body(),
        shared,
    }
}

/// A request body whose progress is tracked (see [`watch_body`]).
pub struct WatchedBody<B> {
    inner: B,
    shared: Option<Arc<Shared>>,
}

impl<B> WatchedBody<B> {
    /// The body has been read (or given up on): its connection is busy
    /// again, not stalled.
    fn done(&mut self) {
        if let Some(s) = self.shared.take() {
            *s.body() = None;
        }
    }
}

impl<B: Body + Unpin> Body for WatchedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        match &r {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(s)) = (frame.data_ref(), &self.shared) {
                    if let Some(b) = s.body().as_mut() {
                        b.advance(data.remaining() as u64, Instant::now());
                    }
                }
            }
            Poll::Ready(_) => self.done(),
            Poll::Pending => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for WatchedBody<B> {
    fn drop(&mut self) {
        self.done();
    }
}

/// A socket whose reads fail once its connection is evicted.
pub struct EvictableIo<T> {
    inner: T,
    shared: Arc<Shared>,
}

impl<T: AsyncRead + Unpin> AsyncRead for EvictableIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.shared.waker.register(cx.waker());
        if self.shared.evicted.load(Ordering::Acquire) {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "evicted to make room for a new connection",
            )));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before
            && self.shared.kept_alive.load(Ordering::Acquire)
            && !self.shared.in_request.load(Ordering::Acquire)
        {
            // The next request's head has begun.
            self.shared.kept_alive.store(false, Ordering::Release);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for EvictableIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Accepts connections within the limits.
pub struct Acceptor {
    listener: TcpListener,
    /// The slots and the connections holding them, for eviction.
    registry: Registry,
    /// Why accept last failed, how often since it was last logged, when.
    failures: u64,
    last_logged: Option<Instant>,
    backoff: Duration,
    what: &'static str,
}

impl Acceptor {
    /// Serves `listener` with `max_connections` normal slots; `what` names
    /// it in logs.
    pub fn new(listener: TcpListener, max_connections: usize, what: &'static str) -> Acceptor {
        Acceptor {
            listener,
            registry: Registry::new(max_connections),
            failures: 0,
            last_logged: None,
            backoff: Duration::ZERO,
            what,
        }
    }

    /// The next connection to serve. Connections beyond both pools are
    /// closed here and never returned. Never waits for a slot.
    pub async fn accept(&mut self) -> Accepted {
        loop {
            let stream = match self.listener.accept().await {
                Ok((s, _)) => {
                    self.backoff = Duration::ZERO;
                    s
                }
                Err(e) => {
                    self.on_error(&e).await;
                    continue;
                }
            };
            let Some((pool, slot)) = self.registry.admit() else {
                // Both pools are full: closing at once frees the descriptor.
                drop(stream);
                refused(Refusal::ClosedAtAccept);
                continue;
            };
            let conn = self.registry.register(pool, slot);
            return Accepted {
                stream: EvictableIo {
                    inner: stream,
                    shared: Arc::clone(&conn.shared),
                },
                overflow: pool == Pool::Overflow,
                conn,
            };
        }
    }

    /// Backs off after a failed accept; descriptor or memory exhaustion
    /// would otherwise fail again at once, in a loop.
    async fn on_error(&mut self, e: &std::io::Error) {
        let exhausted = matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
        );
        if !exhausted {
            // A connection that was reset before it was taken, and the like.
            tracing::debug!("{} accept failed: {e}", self.what);
            return;
        }
        refused(Refusal::AcceptFailed);
        self.failures += 1;
        let due = self
            .last_logged
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(5));
        if due {
            tracing::warn!(
                "{} accept failed ({} times since the last report): {e}; backing off. Raise the open-files limit (ulimit -n) or lower --max-connections.",
                self.what,
                self.failures
            );
            self.failures = 0;
            self.last_logged = Some(Instant::now());
        }
        self.backoff = (self.backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
        tokio::time::sleep(self.backoff).await;
    }
}

/// The header timer of one connection: hyper's, which also counts a
/// [`Refusal::HeaderTimeout`] when it fires on a request head (not on an
/// idle keep-alive connection, whose closing is routine).
#[derive(Clone)]
struct HeaderTimer(Arc<Shared>);

impl hyper::rt::Timer for HeaderTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until(Instant::now() + duration)
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(HeaderSleep {
            sleep: Box::pin(tokio::time::sleep_until(deadline.into())),
            shared: Arc::clone(&self.0),
            fired: false,
        })
    }
}

struct HeaderSleep {
    sleep: Pin<Box<tokio::time::Sleep>>,
    shared: Arc<Shared>,
    fired: bool,
}

impl Future for HeaderSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.fired {
            return Poll::Ready(());
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.fired = true;
                // hyper polls its header timer only while it waits for a
                // head, and closes the connection when it fires.
                if !self.shared.kept_alive.load(Ordering::Acquire) {
                    refused(Refusal::HeaderTimeout);
                }
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl hyper::rt::Sleep for HeaderSleep {}

/// The HTTP/1 settings of connection `conn`: header timeouts always (a
/// shorter one from the overflow pool), and one request per connection
/// from the overflow pool.
pub fn http1_builder(
    limits: &ConnectionLimits,
    conn: &ConnHandle,
) -> hyper::server::conn::http1::Builder {
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(HeaderTimer(Arc::clone(&conn.shared)));
    if conn.overflow {
        b.header_read_timeout(OVERFLOW_HEADER_TIMEOUT)
            .keep_alive(false);
    } else {
        b.header_read_timeout(limits.header_timeout);
    }
    b
}

/// Whether an overflow connection may be served `path` at once: the probes
/// and metrics, which must answer however busy the server is.
pub fn served_when_full(path: &str) -> bool {
    path == "/health" || path.starts_with("/health/") || path == "/ping" || path == "/metrics"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_cap_leaves_room_for_everything_else() {
        assert_eq!(default_max_connections(1024), 1024 - 128 - 64);
        assert_eq!(default_max_connections(1 << 20), DEFAULT_MAX_CONNECTIONS);
        assert_eq!(default_max_connections(100), 16);
    }

    /// A connection of `pool`, idle since `idle` ago, with `requests` in
    /// progress and, if `body` is some, a body last progressing that long
    /// ago.
    fn conn(pool: Pool, idle: Duration, requests: usize, body: Option<Duration>) -> ConnState {
        let now = Instant::now();
        let shared = Arc::new(Shared::default());
        *shared.body() = body.map(|ago| BodyProgress {
            mark: now - ago,
            bytes: 0,
        });
        ConnState {
            pool,
            slot: Some(
                Arc::new(Semaphore::new(1))
                    .try_acquire_owned()
                    .expect("permit"),
            ),
            requests,
            idle_since: now - idle,
            shared,
        }
    }

    fn victim(conns: &HashMap<u64, ConnState>, pool: Pool) -> Option<(u64, Refusal)> {
        choose_victim(conns.iter(), pool, Instant::now()).ok()
    }

    #[test]
    fn eviction_takes_the_connection_stalled_longest_and_never_a_busy_one() {
        let ms = Duration::from_millis;
        let mut conns = HashMap::new();
        // Serving a request whose body has arrived, for long: never.
        conns.insert(1, conn(Pool::Main, ms(60_000), 1, None));
        // Just connected, or just done with a request: not yet.
        conns.insert(2, conn(Pool::Main, ms(10), 0, None));
        // Sending its body promptly: not yet.
        conns.insert(3, conn(Pool::Main, ms(60_000), 1, Some(ms(100))));
        assert_eq!(victim(&conns, Pool::Main), None);
        let next = choose_victim(conns.iter(), Pool::Main, Instant::now());
        assert!(matches!(next, Err(Some(_))), "{next:?}");

        // A body stalled past BODY_STALL, and an idle connection past
        // EVICT_AFTER_IDLE by less: the body goes first.
        conns.insert(4, conn(Pool::Main, ms(700), 0, None));
        conns.insert(5, conn(Pool::Main, ms(60_000), 1, Some(ms(3_000))));
        assert_eq!(
            victim(&conns, Pool::Main),
            Some((5, Refusal::EvictedSlowBody))
        );
        conns
            .get(&5)
            .expect("5")
            .shared
            .evicted
            .store(true, Ordering::Release);
        assert_eq!(victim(&conns, Pool::Main), Some((4, Refusal::EvictedIdle)));
        // The other pool's connections are not candidates.
        assert_eq!(victim(&conns, Pool::Overflow), None);
        conns.insert(6, conn(Pool::Overflow, ms(900), 0, None));
        assert_eq!(
            victim(&conns, Pool::Overflow),
            Some((6, Refusal::EvictedIdle))
        );
        // Nor is a connection whose slot has gone already.
        conns.get_mut(&4).expect("4").slot = None;
        assert_eq!(victim(&conns, Pool::Main), None);
    }

    #[test]
    fn a_body_progresses_only_by_whole_kibibytes() {
        let start = Instant::now();
        let mut b = BodyProgress {
            mark: start,
            bytes: 0,
        };
        let later = start + Duration::from_secs(5);
        // A byte at a time, as a slow-body client sends: no progress.
        for _ in 0..BODY_PROGRESS_BYTES - 1 {
            b.advance(1, later);
        }
        assert_eq!(b.mark, start);
        b.advance(1, later);
        assert_eq!((b.mark, b.bytes), (later, 0));
        b.advance(64 << 10, later + Duration::from_secs(1));
        assert_eq!(b.mark, later + Duration::from_secs(1));
    }

    #[tokio::test]
    async fn stalled_bodies_give_their_slots_to_new_connections_and_waiting_requests() {
        let r = Registry::new(1);
        let (pool, slot) = r.admit().expect("a free slot");
        assert_eq!(pool, Pool::Main);
        let first = r.register(pool, slot);
        let _first_req = first.request_started();
        // Its body began long ago and brought nothing: a new connection
        // takes its slot at once.
        *first.shared.body() = Some(BodyProgress {
            mark: Instant::now() - Duration::from_secs(5),
            bytes: 0,
        });
        let (pool, slot) = r.admit().expect("a slot");
        assert_eq!(pool, Pool::Main);
        assert!(first.shared.evicted.load(Ordering::Acquire));
        assert_eq!(r.lock().evicting, 1);
        let second = r.register(pool, slot);
        let _second_req = second.request_started();
        // Its body has just begun: nothing may be evicted, so the next
        // connection goes to the overflow pool...
        *second.shared.body() = Some(BodyProgress {
            mark: Instant::now(),
            bytes: 0,
        });
        let (pool, slot) = r.admit().expect("an overflow slot");
        assert_eq!(pool, Pool::Overflow);
        let third = r.register(pool, slot);
        let third_req = third.request_started();
        // ... where its request waits until that body has stalled.
        let started = Instant::now();
        assert!(third_req.wait_for_slot().await);
        let waited = started.elapsed();
        assert!(
            waited + Duration::from_millis(20) >= BODY_STALL && waited < SLOT_WAIT,
            "{waited:?}"
        );
        assert!(second.shared.evicted.load(Ordering::Acquire));
        assert_eq!(
            r.lock().map.get(&third.id).map(|c| c.pool),
            Some(Pool::Main)
        );
        // It holds the normal slot now, its overflow one is free again.
        assert_eq!(r.0.main.available_permits(), 0);
        assert_eq!(r.0.overflow.available_permits(), OVERFLOW_SLOTS);
        drop((_first_req, first, _second_req, second));
        assert_eq!(r.lock().evicting, 0);
        // A request that finds no slot in time gets its 503.
        let (pool, slot) = r.admit().expect("an overflow slot");
        assert_eq!(pool, Pool::Overflow);
        let fourth = r.register(pool, slot);
        let fourth_req = fourth.request_started();
        let started = Instant::now();
        assert!(!fourth_req.wait_for_slot().await);
        assert!(started.elapsed() >= SLOT_WAIT);
    }
}
