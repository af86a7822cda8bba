//! Taking connections without letting clients exhaust the server.
//!
//! Every open connection costs a file descriptor, and a process has a fixed
//! number of them. So:
//! - at most [`ConnectionLimits::max_connections`] connections are served
//!   normally at once; beyond that, a small overflow pool answers health
//!   probes and `/metrics` (so Kubernetes still sees the server alive) and
//!   everything else with 503, closing each connection after one request;
//!   past the overflow pool, a connection is accepted and closed at once,
//!   which frees its descriptor instead of leaving it in the kernel's
//!   backlog;
//! - a client must send a request's head within
//!   [`ConnectionLimits::header_timeout`] (idle keep-alive connections
//!   included) and its body within [`BODY_TIMEOUT`], so idle and slow
//!   clients give their slots back;
//! - when every normal slot is taken, a new connection evicts the
//!   connection that has gone longest without a request in progress (an
//!   idle keep-alive connection, or one still dribbling its request head,
//!   as slowloris clients do), provided it has been so for
//!   [`EVICT_AFTER_IDLE`]: connections serving a request are never
//!   evicted, so slow and idle clients cannot hold every slot against
//!   normal requests, whatever the descriptor limit (nginx and Envoy do
//!   the same under pressure);
//! - when `accept` fails for lack of descriptors or memory, the loop backs
//!   off (up to a second) instead of spinning, and logs that at most once
//!   every few seconds, with a count.

use futures_util::task::AtomicWaker;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long a connection must have gone without a request in progress
/// before a new connection may evict it. A client that has just connected
/// sends its request head well within this.
pub const EVICT_AFTER_IDLE: Duration = Duration::from_millis(500);

/// How long a new connection waits for the slot of the one it evicted.
const EVICT_WAIT: Duration = Duration::from_millis(250);

/// How long a client may take to send a request's body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections beyond the normal slots that may still be answered (health
/// probes and 503s), each for one request.
const OVERFLOW_SLOTS: usize = 64;

/// How long an overflow connection may take to send its request's head.
const OVERFLOW_HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// Descriptors kept for everything that is not a client connection: the
/// model files, plugin artifacts, the state directory, logs.
const RESERVED_FDS: u64 = 128;

/// The most connections served normally by default, however many
/// descriptors the process may open.
const DEFAULT_MAX_CONNECTIONS: usize = 16_384;

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
    /// Held for as long as the connection is open.
    pub permit: OwnedSemaphorePermit,
    /// Served from the overflow pool: probes only, one request.
    pub overflow: bool,
    /// Its entry among the open connections (for eviction).
    pub conn: ConnHandle,
}

/// The signal that evicts one connection: its reads fail from then on,
/// which ends the connection (and frees its slot) even while it waits for
/// a request head.
#[derive(Default)]
struct Eviction {
    evicted: AtomicBool,
    waker: AtomicWaker,
}

/// One open connection's standing.
struct ConnState {
    /// Requests in progress (until their response has been sent).
    requests: usize,
    /// Since when none has been.
    idle_since: Instant,
    eviction: Arc<Eviction>,
}

/// The open connections of one listener.
#[derive(Clone, Default)]
struct Registry(Arc<Mutex<(u64, HashMap<u64, ConnState>)>>);

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, HashMap<u64, ConnState>)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn register(&self) -> ConnHandle {
        let eviction = Arc::new(Eviction::default());
        let mut g = self.lock();
        g.0 += 1;
        let id = g.0;
        g.1.insert(
            id,
            ConnState {
                requests: 0,
                idle_since: Instant::now(),
                eviction: Arc::clone(&eviction),
            },
        );
        ConnHandle {
            registry: self.clone(),
            id,
            eviction,
        }
    }

    /// Evicts the connection idle the longest, if one has been idle for
    /// [`EVICT_AFTER_IDLE`]; returns whether one was.
    fn evict_idlest(&self) -> bool {
        let g = self.lock();
        let now = Instant::now();
        let victim =
            g.1.values()
                .filter(|c| c.requests == 0 && now.duration_since(c.idle_since) >= EVICT_AFTER_IDLE)
                .filter(|c| !c.eviction.evicted.load(Ordering::Acquire))
                .min_by_key(|c| c.idle_since);
        match victim {
            Some(c) => {
                c.eviction.evicted.store(true, Ordering::Release);
                c.eviction.waker.wake();
                true
            }
            None => false,
        }
    }
}

/// A connection's entry among the open connections, removed when dropped.
pub struct ConnHandle {
    registry: Registry,
    id: u64,
    eviction: Arc<Eviction>,
}

impl ConnHandle {
    /// Marks a request in progress on the connection until the returned
    /// guard is dropped (when its response has been sent): meanwhile the
    /// connection is never evicted.
    pub fn request_started(&self) -> RequestGuard {
        if let Some(c) = self.registry.lock().1.get_mut(&self.id) {
            c.requests += 1;
        }
        RequestGuard {
            registry: self.registry.clone(),
            id: self.id,
        }
    }
}

impl Drop for ConnHandle {
    fn drop(&mut self) {
        self.registry.lock().1.remove(&self.id);
    }
}

/// A request in progress on a connection (see [`ConnHandle::request_started`]).
pub struct RequestGuard {
    registry: Registry,
    id: u64,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if let Some(c) = self.registry.lock().1.get_mut(&self.id) {
            c.requests = c.requests.saturating_sub(1);
            if c.requests == 0 {
                c.idle_since = Instant::now();
            }
        }
    }
}

/// A socket whose reads fail once its connection is evicted.
pub struct EvictableIo<T> {
    inner: T,
    eviction: Arc<Eviction>,
}

impl<T: AsyncRead + Unpin> AsyncRead for EvictableIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.eviction.waker.register(cx.waker());
        if self.eviction.evicted.load(Ordering::Acquire) {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "evicted to make room for a new connection",
            )));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
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
    slots: Arc<Semaphore>,
    overflow: Arc<Semaphore>,
    /// The connections holding normal slots, for eviction.
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
            slots: Arc::new(Semaphore::new(max_connections)),
            overflow: Arc::new(Semaphore::new(OVERFLOW_SLOTS)),
            registry: Registry::default(),
            failures: 0,
            last_logged: None,
            backoff: Duration::ZERO,
            what,
        }
    }

    /// The next connection to serve. Connections beyond both pools are
    /// closed here and never returned.
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
            let mut permit = Arc::clone(&self.slots).try_acquire_owned().ok();
            // Every slot taken: the connection idle the longest makes room.
            if permit.is_none() && self.registry.evict_idlest() {
                let slot = Arc::clone(&self.slots).acquire_owned();
                permit = tokio::time::timeout(EVICT_WAIT, slot)
                    .await
                    .ok()
                    .and_then(Result::ok);
            }
            if let Some(permit) = permit {
                let conn = self.registry.register();
                return Accepted {
                    stream: EvictableIo {
                        inner: stream,
                        eviction: Arc::clone(&conn.eviction),
                    },
                    permit,
                    overflow: false,
                    conn,
                };
            }
            if let Ok(permit) = Arc::clone(&self.overflow).try_acquire_owned() {
                // Overflow connections serve one probe and close; they are
                // never evicted (a registry of their own, never consulted).
                let conn = Registry::default().register();
                return Accepted {
                    stream: EvictableIo {
                        inner: stream,
                        eviction: Arc::clone(&conn.eviction),
                    },
                    permit,
                    overflow: true,
                    conn,
                };
            }
            // Both pools are full: closing at once frees the descriptor.
            drop(stream);
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

/// The HTTP/1 settings of a connection: header timeouts always, and one
/// request per connection from the overflow pool.
pub fn http1_builder(
    limits: &ConnectionLimits,
    overflow: bool,
) -> hyper::server::conn::http1::Builder {
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(hyper_util::rt::TokioTimer::new());
    if overflow {
        b.header_read_timeout(OVERFLOW_HEADER_TIMEOUT)
            .keep_alive(false);
    } else {
        b.header_read_timeout(limits.header_timeout);
    }
    b
}

/// Whether an overflow connection may be served `path`: the probes and
/// metrics, which must answer however busy the server is.
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
}
