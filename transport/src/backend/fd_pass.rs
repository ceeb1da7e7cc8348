//! Passing `shm` regions between processes as file descriptors (`SCM_RIGHTS`), so that no
//! message ever names a descriptor of another process.
//!
//! Every process that owns [`ShmMemory`] runs one *descriptor server*: a thread listening on
//! an abstract Unix socket (`pdserve-shm-PID-RANDOM`; abstract names live in the network
//! namespace, like the loopback TCP connection the `shm` backend already needs). A peer asks
//! it for a region by `(ticket, key)` and receives the memfd itself.
//!
//! Who may ask, and whom the asker believes:
//! - The server answers only a process of its own uid (`SO_PEERCRED` of the connection), and
//!   only for a ticket it issued with a `GET_REGIONS` answer on an authenticated transfer
//!   connection ([`issue_ticket`]), for the regions that answer listed, for [`TICKET_TTL`].
//! - The asker maps only what a server of its own uid passed, and only when that server's
//!   process (`SO_PEERCRED` again, fixed when it called `listen`) holds the other end of the
//!   transfer connection the descriptors came on: a peer that names another process's socket
//!   gets nothing mapped. What arrives must be a pdserve memfd of at least the described size.
//!
//! The protocol is fixed-size: a request is `ticket (16) | key (u64 LE)`; an answer is one
//! status byte, with the memfd attached when it is [`ANS_OK`].
//!
//! [`ShmMemory`]: crate::memory::ShmMemory

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Result, TransportError};

/// Prefix of every descriptor server's socket name.
pub(crate) const SOCKET_PREFIX: &str = "pdserve-shm-";
/// Longest socket name accepted from a peer (the kernel's limit is 107 bytes).
pub(crate) const MAX_SOCKET_NAME: usize = 64;
/// How long a ticket opens its regions.
pub(crate) const TICKET_TTL: Duration = Duration::from_secs(60);
/// Most live tickets (the oldest goes first).
const MAX_TICKETS: usize = 4096;
/// Most connections the server serves at once; more are closed unanswered.
const MAX_CONNECTIONS: usize = 16;
/// Most requests on one connection.
const MAX_REQUESTS: usize = 65_536;
/// A silent connection is closed after this long (both sides).
const IO_TIMEOUT: Duration = Duration::from_secs(5);

const REQUEST_BYTES: usize = 24;
/// The region's memfd is attached.
pub(crate) const ANS_OK: u8 = 0;
/// Unknown or expired ticket.
const ANS_TICKET: u8 = 1;
/// The ticket does not cover this region, or it is gone.
const ANS_REGION: u8 = 2;

/// A capability to fetch the regions one answer listed.
pub(crate) type Ticket = [u8; 16];

/// Looks up a live region of this process by key: its memfd and length.
pub(crate) type RegionLookup = fn(u64) -> Option<(Arc<OwnedFd>, usize)>;

struct Server {
    name: String,
    lookup: RegionLookup,
}

static SERVER: OnceLock<Server> = OnceLock::new();

/// Starts this process's descriptor server on first use (regions are looked up with
/// `lookup`) and returns its socket name.
///
/// # Errors
/// The OS error of binding the socket or starting its thread.
pub(crate) fn serve(lookup: RegionLookup) -> std::io::Result<&'static str> {
    if let Some(s) = SERVER.get() {
        return Ok(&s.name);
    }
    static START: Mutex<()> = Mutex::new(());
    let _once = START.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = SERVER.get() {
        return Ok(&s.name);
    }
    let name = format!(
        "{SOCKET_PREFIX}{}-{}",
        std::process::id(),
        hex(&random::<8>()?)
    );
    let listener = UnixListener::bind_addr(&UnixAddr::from_abstract_name(name.as_bytes())?)?;
    std::thread::Builder::new()
        .name("pdserve-shm-fds".into())
        .spawn(move || accept_loop(listener))?;
    Ok(&SERVER.get_or_init(|| Server { name, lookup }).name)
}

fn accept_loop(listener: UnixListener) {
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let conn = match listener.accept() {
            Ok((conn, _)) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "shm descriptor server: accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::AcqRel);
            continue; // dropped: closed unanswered
        }
        let active = active.clone();
        let spawned = std::thread::Builder::new()
            .name("pdserve-shm-fd".into())
            .spawn(move || {
                if let Err(e) = answer(conn) {
                    tracing::debug!(error = %e, "shm descriptor connection ended");
                }
                active.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            // The closure (and its decrement) never ran.
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Serves one connection: only a process of our uid, only what its ticket covers.
fn answer(mut conn: UnixStream) -> std::io::Result<()> {
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    let (_, uid) = peer_cred(&conn)?;
    // SAFETY: geteuid has no preconditions.
    if uid != unsafe { libc::geteuid() } {
        return Ok(()); // closed unanswered: another user learns nothing
    }
    let server = SERVER.get().expect("a connection implies a server");
    for _ in 0..MAX_REQUESTS {
        let mut req = [0u8; REQUEST_BYTES];
        match conn.read_exact(&mut req) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let ticket: Ticket = req[..16].try_into().expect("16 bytes");
        let key = u64::from_le_bytes(req[16..].try_into().expect("8 bytes"));
        match tickets().covers(&ticket, key, Instant::now()) {
            None => conn.write_all(&[ANS_TICKET])?,
            Some(false) => conn.write_all(&[ANS_REGION])?,
            Some(true) => match (server.lookup)(key) {
                Some((fd, _)) => send_with_fd(&conn, ANS_OK, fd.as_raw_fd())?,
                None => conn.write_all(&[ANS_REGION])?,
            },
        }
    }
    Ok(())
}

/// Tickets issued and not yet expired, oldest first.
#[derive(Default)]
struct TicketBook {
    live: HashMap<Ticket, (Instant, HashSet<u64>)>,
    order: VecDeque<(Instant, Ticket)>,
}

impl TicketBook {
    fn insert(&mut self, ticket: Ticket, keys: HashSet<u64>, now: Instant) {
        while let Some(&(expires, old)) = self.order.front() {
            if expires > now && self.order.len() < MAX_TICKETS {
                break;
            }
            self.order.pop_front();
            self.live.remove(&old);
        }
        let expires = now + TICKET_TTL;
        self.live.insert(ticket, (expires, keys));
        self.order.push_back((expires, ticket));
    }

    /// `None`: no such live ticket; else whether it covers `key`.
    fn covers(&self, ticket: &Ticket, key: u64, now: Instant) -> Option<bool> {
        let (expires, keys) = self.live.get(ticket)?;
        (*expires > now).then(|| keys.contains(&key))
    }
}

struct Tickets(Mutex<TicketBook>);

impl Tickets {
    fn covers(&self, ticket: &Ticket, key: u64, now: Instant) -> Option<bool> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .covers(ticket, key, now)
    }
}

fn tickets() -> &'static Tickets {
    static T: OnceLock<Tickets> = OnceLock::new();
    T.get_or_init(|| Tickets(Mutex::new(TicketBook::default())))
}

/// Issues a ticket that opens the regions `keys` of this process for [`TICKET_TTL`].
///
/// # Errors
/// The OS random source failed.
pub(crate) fn issue_ticket(keys: HashSet<u64>) -> Result<Ticket> {
    let ticket = random::<16>()?;
    tickets()
        .0
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(ticket, keys, Instant::now());
    Ok(ticket)
}

/// Fetches the memfds of `keys` from the descriptor server `socket`, in order. The server's
/// process must be of our uid and `is_peer` (the process at the other end of the connection
/// the descriptors came on); otherwise nothing is asked and nothing is received.
pub(crate) fn fetch(
    socket: &str,
    ticket: &Ticket,
    keys: &[u64],
    is_peer: impl Fn(u32) -> bool,
) -> Result<Vec<OwnedFd>> {
    let refuse = |why: String| TransportError::Unauthenticated(format!("shm peer: {why}"));
    check_socket_name(socket)?;
    let addr = UnixAddr::from_abstract_name(socket.as_bytes())?;
    let mut conn = UnixStream::connect_addr(&addr)
        .map_err(|e| refuse(format!("its descriptor server cannot be reached ({e})")))?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    let (pid, uid) = peer_cred(&conn)?;
    // SAFETY: geteuid has no preconditions.
    if uid != unsafe { libc::geteuid() } {
        return Err(refuse(
            "its descriptor server runs as another user (shm needs both processes under one uid)"
                .into(),
        ));
    }
    if !is_peer(pid) {
        return Err(refuse(
            "the descriptor server it named is not the process at the other end of our connection"
                .into(),
        ));
    }
    let mut fds = Vec::with_capacity(keys.len());
    for &key in keys {
        let mut req = [0u8; REQUEST_BYTES];
        req[..16].copy_from_slice(ticket);
        req[16..].copy_from_slice(&key.to_le_bytes());
        conn.write_all(&req)?;
        let (status, fd) = recv_with_fd(&conn)?;
        match (status, fd) {
            (ANS_OK, Some(fd)) => fds.push(fd),
            (ANS_TICKET, None) => return Err(refuse("it refused our ticket".into())),
            (ANS_REGION, None) => {
                return Err(TransportError::LayoutMismatch(format!(
                    "the peer no longer shares region key {key}"
                )))
            }
            _ => {
                return Err(TransportError::Protocol(
                    "malformed answer from a shm descriptor server".into(),
                ))
            }
        }
    }
    Ok(fds)
}

/// A peer's socket name must be one of ours: bounded, our prefix, `[0-9a-f-]` after it.
pub(crate) fn check_socket_name(name: &str) -> Result<()> {
    let ok = name.len() <= MAX_SOCKET_NAME
        && name.strip_prefix(SOCKET_PREFIX).is_some_and(|rest| {
            !rest.is_empty()
                && rest
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b) || b == b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(TransportError::LayoutMismatch(
            "the peer's shm handle does not name a pdserve descriptor server".into(),
        ))
    }
}

/// (pid, uid) of the process at the other end of a Unix socket (for a connecting client:
/// the process that called `listen`).
fn peer_cred(conn: &UnixStream) -> std::io::Result<(u32, u32)> {
    // SAFETY: plain-old-data out parameter, written by getsockopt.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: valid socket, out pointer and its length.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cred.pid as u32, cred.uid))
}

/// Room for one descriptor's control message.
const CMSG_ROOM: usize = 64;

#[repr(C, align(8))]
struct CmsgBuf([u8; CMSG_ROOM]);

fn send_with_fd(conn: &UnixStream, status: u8, fd: i32) -> std::io::Result<()> {
    let mut byte = [status];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut buf = CmsgBuf([0; CMSG_ROOM]);
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as usize;
    assert!(space <= CMSG_ROOM);
    // SAFETY: msghdr is plain data; every pointer set below outlives the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = buf.0.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds `space` bytes, enough for one header and one int.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>(), fd);
    }
    // SAFETY: a valid socket and a message built above.
    let n = unsafe { libc::sendmsg(conn.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n != 1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Receives one status byte and at most one descriptor; any other descriptors that came
/// with it are closed, and a truncated control message is an error.
fn recv_with_fd(conn: &UnixStream) -> Result<(u8, Option<OwnedFd>)> {
    let mut byte = [0u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut buf = CmsgBuf([0; CMSG_ROOM]);
    // SAFETY: msghdr is plain data; every pointer set below outlives the recvmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = buf.0.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_ROOM as _;
    // SAFETY: a valid socket and buffers of the sizes given.
    let n = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `buf`.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let count = ((*cmsg).cmsg_len as usize - (data as usize - cmsg as usize))
                    / std::mem::size_of::<i32>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.cast::<i32>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if n == 0 {
        return Err(TransportError::Protocol(
            "the shm descriptor server closed the connection".into(),
        ));
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > 1 {
        return Err(TransportError::Protocol(
            "a shm descriptor server passed more than one descriptor".into(),
        ));
    }
    Ok((byte[0], fds.pop()))
}

fn random<const N: usize>() -> std::io::Result<[u8; N]> {
    use ring::rand::SecureRandom;
    let mut b = [0u8; N];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| std::io::Error::other("the OS random source failed"))?;
    Ok(b)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_expire_and_are_bounded() {
        let mut book = TicketBook::default();
        let t0 = Instant::now();
        book.insert([1; 16], HashSet::from([5]), t0);
        assert_eq!(book.covers(&[1; 16], 5, t0), Some(true));
        assert_eq!(book.covers(&[1; 16], 6, t0), Some(false));
        assert_eq!(book.covers(&[2; 16], 5, t0), None);
        assert_eq!(book.covers(&[1; 16], 5, t0 + TICKET_TTL), None);
        for i in 0..MAX_TICKETS as u32 + 10 {
            let mut t = [0u8; 16];
            t[..4].copy_from_slice(&i.to_le_bytes());
            t[15] = 9;
            book.insert(t, HashSet::new(), t0);
        }
        assert!(book.live.len() <= MAX_TICKETS && book.order.len() == book.live.len());
        // The first ticket went first.
        assert_eq!(book.covers(&[1; 16], 5, t0), None);
    }

    #[test]
    fn socket_names_from_peers_are_checked() {
        check_socket_name("pdserve-shm-42-00ff").unwrap();
        for bad in [
            "",
            "pdserve-shm-",
            "other-42",
            "pdserve-shm-42/../x",
            "pdserve-shm-4\u{0}2",
            &format!("pdserve-shm-{}", "a".repeat(MAX_SOCKET_NAME)),
        ] {
            assert!(check_socket_name(bad).is_err(), "{bad:?}");
        }
    }
}
