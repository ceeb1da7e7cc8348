//! Which process is at the other end of a loopback TCP connection: the `shm` backend takes a
//! peer's memory only from a descriptor server run by the process it is talking to (see
//! [`super::fd_pass`]) — never from a process the peer merely names.
//!
//! The kernel lists every TCP socket of the network namespace in `/proc/net/tcp{,6}` with its
//! inode; the peer's socket is the one whose local address is our peer address and whose
//! remote address is our local one. A process holds it when one of its descriptors links to
//! `socket:[INODE]`.

use std::net::{IpAddr, SocketAddr};

/// Whether process `pid` holds the peer end of the TCP connection `ends` (local, peer).
pub(crate) fn holds_peer_socket(pid: u32, ends: (SocketAddr, SocketAddr)) -> bool {
    let (local, peer) = ends;
    let Some(inode) = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| {
            let text = std::fs::read_to_string(table).ok()?;
            socket_inode(&text, peer, local)
        })
    else {
        return false;
    };
    let want = format!("socket:[{inode}]");
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten()
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t.to_str() == Some(want.as_str())))
}

/// The inode of the socket in a `/proc/net/tcp{,6}` table whose local address is `local` and
/// remote address `remote` (an established connection has exactly one).
fn socket_inode(table: &str, local: SocketAddr, remote: SocketAddr) -> Option<u64> {
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        // sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
        if f.len() < 10 {
            return None;
        }
        let (l, r) = (parse_addr(f[1])?, parse_addr(f[2])?);
        (same(l, local) && same(r, remote)).then(|| f[9].parse().ok())?
    })
}

fn same(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && a.ip().to_canonical() == b.ip().to_canonical()
}

/// `0100007F:1F90` (IPv4) or 32 hex digits `:PORT` (IPv6): the address's 32-bit words in
/// host (little-endian) order.
fn parse_addr(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        Some(
            u32::from_str_radix(ip.get(8 * i..8 * i + 8)?, 16)
                .ok()?
                .to_le_bytes(),
        )
    };
    let ip = match ip.len() {
        8 => IpAddr::from(word(0)?),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[4 * i..4 * i + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::from(b)
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_addresses_parse() {
        assert_eq!(
            parse_addr("0100007F:1F90"),
            Some("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(
            parse_addr("00000000000000000000000001000000:0050"),
            Some("[::1]:80".parse().unwrap())
        );
        assert_eq!(
            parse_addr("0000000000000000FFFF00000100007F:0050"),
            Some("[::ffff:127.0.0.1]:80".parse().unwrap())
        );
        assert_eq!(parse_addr("zz:1"), None);
        assert_eq!(parse_addr("0100007F"), None);
    }

    #[test]
    fn this_process_holds_both_ends_of_its_own_connection_and_no_other_does() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let ends = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        assert!(holds_peer_socket(std::process::id(), ends));
        // PID 1 (init) holds neither end.
        assert!(!holds_peer_socket(1, ends));
        // A connection that does not exist is held by nobody.
        let none = (ends.0, "127.0.0.1:1".parse().unwrap());
        assert!(!holds_peer_socket(std::process::id(), none));
    }
}
