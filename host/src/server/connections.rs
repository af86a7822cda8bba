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
//! - when `accept` fails for lack of descriptors or memory, the loop backs
//!   off (up to a second) instead of spinning, and logs that at most once
//!   every few seconds, with a count.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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
    pub stream: TcpStream,
    /// Held for as long as the connection is open.
    pub permit: OwnedSemaphorePermit,
    /// Served from the overflow pool: probes only, one request.
    pub overflow: bool,
}

/// Accepts connections within the limits.
pub struct Acceptor {
    listener: TcpListener,
    slots: Arc<Semaphore>,
    overflow: Arc<Semaphore>,
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
            if let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() {
                return Accepted {
                    stream,
                    permit,
                    overflow: false,
                };
            }
            if let Ok(permit) = Arc::clone(&self.overflow).try_acquire_owned() {
                return Accepted {
                    stream,
                    permit,
                    overflow: true,
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
