//! Issue 22, point 9 ("limit per peer address"; review F2): one peer holding
//! every connection place with idle connections past their handshake cannot
//! keep another peer out. At `--max-connections`, a peer holding at least two
//! places more than a newcomer's gives up its newest connection for it; a
//! newcomer of the peer holding the most is refused (the holder, not
//! everyone); one peer alone may use every place. And
//! `--max-connections-per-peer` caps a peer outright.

mod common;

use common::flood::connect_from;
use common::*;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Every legitimate connection must be served within this.
const PER_CLIENT: Duration = Duration::from_secs(5);

/// A full client from `from`: greeting, flags, `NBD_OPT_EXPORT_NAME`. The
/// connection past its handshake, or why there is none (refused: closed
/// before the greeting).
fn open_from(from: Ipv4Addr, to: SocketAddr, name: &str) -> Result<TcpStream, String> {
    let mut s = connect_from(from, to, PER_CLIENT).map_err(|e| format!("connect: {e}"))?;
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello)
        .map_err(|e| format!("no greeting: {e}"))?;
    if hello[..8] != NBDMAGIC.to_be_bytes() {
        return Err(format!("bad greeting {hello:?}"));
    }
    let mut out = 3u32.to_be_bytes().to_vec();
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&NBD_OPT_EXPORT_NAME.to_be_bytes());
    out.extend_from_slice(&u32::try_from(name.len()).unwrap().to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    s.write_all(&out).map_err(|e| format!("send: {e}"))?;
    let mut export = [0u8; 10];
    s.read_exact(&mut export)
        .map_err(|e| format!("no export reply: {e}"))?;
    Ok(s)
}

/// A 4 KiB read at 0 on `s`, checked against `expect`.
fn read_ok(s: &mut TcpStream, handle: u64, expect: &[u8]) -> Result<(), String> {
    s.write_all(&RawClient::request_bytes(
        REQUEST_MAGIC,
        0,
        NBD_CMD_READ,
        handle,
        0,
        4096,
    ))
    .map_err(|e| format!("send: {e}"))?;
    let mut reply = [0u8; 16];
    s.read_exact(&mut reply)
        .map_err(|e| format!("no reply: {e}"))?;
    let mut data = vec![0u8; 4096];
    s.read_exact(&mut data)
        .map_err(|e| format!("no data: {e}"))?;
    if reply[4..8] != [0; 4] || data != expect {
        return Err(format!("bad reply {reply:?}"));
    }
    Ok(())
}

/// Whether the server closed `s` (within a few seconds).
fn closed(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == ErrorKind::ConnectionReset,
    }
}

/// Wait up to 5 s for a line of loopd's log with every one of `needles`.
#[track_caller]
fn log_line(srv: &Server, needles: &[&str]) -> String {
    let t = Instant::now();
    loop {
        let log = srv.stderr_text();
        if let Some(l) = log.lines().find(|l| needles.iter().all(|n| l.contains(n))) {
            return l.to_string();
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no line with {needles:?}:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The reviewer's case: `--max-connections 4`, 127.0.0.1 holds all four
/// places with idle connections; a client of 127.0.0.2 is served, and the
/// newest of 127.0.0.1's connections is closed for it.
#[test]
fn one_peer_holding_every_place_does_not_lock_out_another() {
    let dir = tempdir();
    let img = dir.path().join("s.img");
    create_pattern_image(&img, MIB, 8);
    let expect = read_range(&img, 0, 4096);
    let srv = Server::builder(&img)
        .tcp()
        .args(["--max-connections", "4"])
        .start();
    let to: SocketAddr = format!("127.0.0.1:{}", srv.port()).parse().unwrap();
    let (one, two, three) = (
        Ipv4Addr::new(127, 0, 0, 1),
        Ipv4Addr::new(127, 0, 0, 2),
        Ipv4Addr::new(127, 0, 0, 3),
    );
    // One peer alone may use every place.
    let mut held: Vec<TcpStream> = (0..4)
        .map(|i| open_from(one, to, "s").unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect();
    for (i, s) in held.iter_mut().enumerate() {
        read_ok(s, i as u64, &expect).expect("every place of a lone peer serves");
    }
    // Its fifth is refused: every place is its own.
    assert!(
        open_from(one, to, "s").is_err(),
        "a fifth connection got in"
    );
    // Another peer is served, within the bound.
    let t = Instant::now();
    let mut other = open_from(two, to, "s").unwrap_or_else(|e| {
        panic!("a client of another peer was locked out by one holding every place: {e}")
    });
    read_ok(&mut other, 9, &expect).expect("the other peer's read");
    let took = t.elapsed();
    eprintln!("the other peer was served in {took:?}");
    assert!(took < PER_CLIENT, "served after {took:?}");
    // The holder's newest connection made room; the others still serve.
    assert!(
        closed(&mut held[3]),
        "the newest of the holder's connections is closed"
    );
    for (i, s) in held[..3].iter_mut().enumerate() {
        read_ok(s, 20 + i as u64, &expect).expect("the holder's older connections go on");
    }
    // The holder (3 places, against 1) is refused, not the others: a third
    // peer gets a place from it too.
    assert!(
        open_from(one, to, "s").is_err(),
        "the holder got a place back"
    );
    let mut third = open_from(three, to, "s").expect("a third peer is served");
    read_ok(&mut third, 30, &expect).unwrap();
    assert!(closed(&mut held[2]), "the holder's next newest made room");
    let l = log_line(
        &srv,
        &["closing the NBD connection of 127.0.0.1:", "for 127.0.0.2:"],
    );
    assert!(
        l.contains("the newest of the 4 places its peer 127.0.0.1 holds")
            && l.contains("--max-connections 4 reached"),
        "{l}"
    );
    log_line(
        &srv,
        &["disconnected", "closed to make room for another peer"],
    );
    let l = log_line(
        &srv,
        &["refusing new NBD clients", "its peer 127.0.0.1 holds 3"],
    );
    assert!(l.contains("--max-connections 4 reached"), "{l}");
}

/// `--max-connections-per-peer 2`: a peer's third connection is refused
/// with a line naming the limit, while places are free for other peers.
#[test]
fn a_peer_past_its_own_limit_is_refused() {
    let dir = tempdir();
    let img = dir.path().join("c.img");
    create_pattern_image(&img, MIB, 9);
    let expect = read_range(&img, 0, 4096);
    let srv = Server::builder(&img)
        .tcp()
        .args(["--max-connections", "8", "--max-connections-per-peer", "2"])
        .start();
    let to: SocketAddr = format!("127.0.0.1:{}", srv.port()).parse().unwrap();
    let one = Ipv4Addr::new(127, 0, 0, 1);
    let _held: Vec<TcpStream> = (0..2)
        .map(|_| open_from(one, to, "c").expect("within the peer's limit"))
        .collect();
    assert!(open_from(one, to, "c").is_err(), "a third got in");
    let mut other = open_from(Ipv4Addr::new(127, 0, 0, 2), to, "c").expect("another peer");
    read_ok(&mut other, 1, &expect).unwrap();
    let l = log_line(&srv, &["refusing NBD client 127.0.0.1:"]);
    assert!(
        l.contains("its peer 127.0.0.1 holds 2 connections (--max-connections-per-peer 2)"),
        "{l}"
    );
}
