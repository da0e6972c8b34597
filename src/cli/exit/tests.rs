//! Tests of [`super`]: the classes of every code, and the one rule for
//! error chains checked over every error the CLI can print.

use super::*;

#[test]
fn every_protocol_code_has_a_distinct_class() {
    assert_eq!(status_for(code_str(ErrorCode::NotFound)), NOT_FOUND);
    assert_eq!(status_for(code_str(ErrorCode::Busy)), BUSY);
    assert_eq!(status_for(code_str(ErrorCode::NameTaken)), NAME_TAKEN);
    assert_eq!(status_for(code_str(ErrorCode::Invalid)), INVALID);
    assert_eq!(status_for(code_str(ErrorCode::BadRequest)), INVALID);
    assert_eq!(status_for(code_str(ErrorCode::Unavailable)), UNAVAILABLE);
    assert_eq!(status_for(code_str(ErrorCode::ShuttingDown)), NOT_RUNNING);
    assert_eq!(status_for(code_str(ErrorCode::Io)), OTHER);
    assert_eq!(status_for("not_running"), NOT_RUNNING);
    assert_eq!(status_for("usage"), USAGE);
    assert_eq!(OK, 0);
}

#[test]
fn codes_match_the_wire_names() {
    for c in [
        ErrorCode::BadRequest,
        ErrorCode::UnsupportedVersion,
        ErrorCode::NotFound,
        ErrorCode::NameTaken,
        ErrorCode::Busy,
        ErrorCode::Invalid,
        ErrorCode::Io,
        ErrorCode::DirectRefused,
        ErrorCode::ShuttingDown,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
    ] {
        assert_eq!(serde_json::to_value(c).unwrap(), code_str(c));
    }
}

#[test]
fn classify_finds_the_daemon_code_in_the_chain() {
    let e = anyhow::Error::new(DaemonError(ErrorBody {
        code: ErrorCode::Busy,
        message: "x".into(),
    }))
    .context("detach");
    assert_eq!(classify(&e), "busy");
    let c = anyhow::Error::new(ClientError::Connect(
        "/nope".into(),
        std::io::Error::from(std::io::ErrorKind::NotFound),
    ));
    assert_eq!(classify(&c), "not_running");
}

#[test]
fn the_repeat_check_finds_the_issues_examples() {
    for bad in [
        "TLS: /c/server-cert.pem: missing: /c/server-cert.pem: missing",
        "--metrics 0.0.0.0:9: cannot listen: Address already in use (os error 98): \
         Address already in use (os error 98)",
        "'/i/x.img' (missing: cannot attach '/i/x.img': cannot open '/i/x.img': gone)",
    ] {
        assert!(loopd::text::repeated_cause(bad).is_some(), "{bad}");
    }
    assert_eq!(
        loopd::text::repeated_cause("cannot listen on 127.0.0.1:1: Address already in use"),
        None
    );
}

fn io(kind: std::io::ErrorKind) -> std::io::Error {
    std::io::Error::from(kind)
}

fn enoent() -> std::io::Error {
    std::io::Error::from_raw_os_error(libc::ENOENT)
}

/// Every error the CLI prints — of `serve`'s start-up (each variant of
/// the server's, listeners', metrics', TLS, state, config, pid file and
/// activation errors, with realistic sources), of the control client,
/// and the daemon's replies (each `CtlError` the control path sends) —
/// printed as `loopd: error:` prints it: each cause once, no path three
/// times, and a class that is not `internal`.
#[test]
fn every_printed_error_says_each_cause_once() {
    use loopd::backing::create::CreateError;
    use loopd::daemon::blockdev::BlockdevError;
    use loopd::device::DeviceError;
    use loopd::frontend::ublk::ctrl::CtrlError;
    use loopd::kernel_nbd::KernelNbdError;
    use loopd::server::daemonize::DaemonizeError;
    use loopd::server::notify::NotifyError;
    use std::io::ErrorKind as K;
    use std::path::PathBuf;
    let p = |s: &str| PathBuf::from(s);
    let cert = p("/etc/loopd/tls/server-cert.pem");
    let img = p("/srv/images/vm disk.img");
    let tls = || {
        vec![
            TlsError::Missing {
                path: cert.clone(),
                why: "",
            },
            TlsError::Read {
                path: cert.clone(),
                source: io(K::PermissionDenied),
            },
            TlsError::Content {
                path: cert.clone(),
                what: "no certificate in it".into(),
            },
            TlsError::KeyMismatch {
                cert: cert.clone(),
                key: p("/etc/loopd/tls/server-key.pem"),
            },
            TlsError::Config {
                dir: p("/etc/loopd/tls"),
                source: rustls::Error::General("bad".into()),
            },
            TlsError::Certificate("truncated".into()),
        ]
    };
    let listen = || {
        vec![
            ListenError::SocketDir(p("/run/loopd"), io(K::PermissionDenied)),
            ListenError::SocketInUse(p("/run/loopd/loopd.sock"), "pass --socket"),
            ListenError::BindUnix(p("/run/loopd/loopd.sock"), io(K::AddrInUse)),
            ListenError::NotASocket {
                option: "--socket",
                path: img.clone(),
                kind: "a regular file",
            },
            ListenError::Inspect(p("/run/x"), io(K::PermissionDenied)),
            ListenError::Appeared(p("/run/x")),
            ListenError::SocketMode(p("/run/x"), io(K::PermissionDenied)),
            ListenError::BindTcp("0.0.0.0:10809".into(), io(K::AddrInUse)),
            ListenError::UnsafeDir {
                path: p("/run/user/1/loopd"),
                why: "it is a symbolic link".into(),
            },
            ListenError::BadListen("1.2.3.4:x".into()),
            ListenError::UnknownGroup("diks".into()),
        ]
    };
    let metrics = || {
        vec![
            MetricsError::BindTcp("0.0.0.0:9100".into(), io(K::AddrInUse)),
            MetricsError::Spawn(io(K::OutOfMemory)),
        ]
    };
    let blockdev = |source: BlockdevError| CtlError::Blockdev {
        name: "vm".into(),
        source,
    };
    let device = |source: DeviceError| CtlError::Device {
        msg: format!("cannot attach {}", loopd::text::quoted_path(&img)),
        source,
    };
    let ctl = || {
        vec![
            CtlError::NotFound("vm".into()),
            CtlError::NameTaken("vm".into()),
            CtlError::Busy("clients are connected".into()),
            CtlError::Invalid("offset 100 is not a multiple of the block size 512".into()),
            CtlError::ShuttingDown,
            CtlError::TlsOff,
            CtlError::Tls(TlsError::Missing {
                path: cert.clone(),
                why: "",
            }),
            blockdev(BlockdevError::Ctrl(CtrlError::NotAvailable {
                path: p("/dev/ublk-control"),
            })),
            blockdev(BlockdevError::Ctrl(CtrlError::NoAccess {
                path: p("/dev/ublk-control"),
                source: io(K::PermissionDenied),
            })),
            blockdev(BlockdevError::Nbd(KernelNbdError::NoModule)),
            blockdev(BlockdevError::Depth(0)),
            device(DeviceError::Open {
                path: img.clone(),
                source: enoent(),
            }),
            device(DeviceError::Stat {
                path: img.clone(),
                source: enoent(),
            }),
            device(DeviceError::Create {
                path: img.clone(),
                source: CreateError::Size {
                    size: 1 << 30,
                    source: io(K::StorageFull),
                },
            }),
            device(DeviceError::Lock(LockError::InUse {
                path: img.clone(),
                why: "qemu (pid 7) holds it".into(),
            })),
            device(DeviceError::Lock(LockError::Open {
                path: img.clone(),
                source: enoent(),
            })),
            device(DeviceError::Empty),
        ]
    };
    let mut errors: Vec<anyhow::Error> = Vec::new();
    for t in tls() {
        errors.push(t.into());
    }
    for t in tls() {
        errors.push(ServerError::Tls(t).into());
    }
    for l in listen() {
        errors.push(ServerError::Listen(l).into());
    }
    for m in metrics() {
        errors.push(ServerError::Metrics(m).into());
    }
    for c in ctl() {
        // At start (`serve IMAGE --blockdev`), and as a control reply.
        errors.push(DaemonError(c.body()).into());
        errors.push(ServerError::Blockdev(Box::new(c)).into());
    }
    errors.push(ServerError::TlsNoCerts("require").into());
    errors.push(ServerError::Signals(io(K::Other)).into());
    errors.push(ServerError::Poll(io(K::Interrupted)).into());
    for s in [
        StateError::Write("/var/lib/loopd/a.state".into(), io(K::StorageFull)),
        StateError::Read("/var/lib/loopd/a.state".into(), io(K::PermissionDenied)),
        StateError::NotState("/var/lib/loopd/a.state".into(), "no header"),
        StateError::Locked {
            path: "/var/lib/loopd/a.state".into(),
            pid: "7".into(),
        },
        StateError::Lock("/var/lib/loopd/a.state".into(), io(K::PermissionDenied)),
        StateError::SaveDamaged(
            "/var/lib/loopd/a.state".into(),
            "/var/lib/loopd/a.state.damaged".into(),
            io(K::StorageFull),
        ),
    ] {
        errors.push(s.into());
    }
    let cfg = p("/etc/loopd/devices.toml");
    errors.push(ConfigError::Read(cfg.clone(), enoent()).into());
    errors.push(
        anyhow::Error::new(ConfigError::Parse(
            cfg.clone(),
            "unknown field `imgae`".into(),
        ))
        .context("reading --config"),
    );
    for e in [
        PidFileError::Held {
            path: p("/run/loopd.pid"),
            pid: " (pid 7)".into(),
        },
        PidFileError::Alive {
            path: p("/run/loopd.pid"),
            pid: 7,
            comm: "sshd".into(),
        },
        PidFileError::NotPidFile {
            path: p("/run/loopd.pid"),
            what: "a directory".into(),
        },
        PidFileError::Inspect(p("/run/loopd.pid"), io(K::PermissionDenied)),
        PidFileError::Changed(p("/run/loopd.pid")),
        PidFileError::Write(p("/run/loopd.pid"), io(K::StorageFull)),
    ] {
        errors.push(e.into());
    }
    errors.push(ActivationError::BadPid("x".into()).into());
    errors.push(DaemonizeError::Fork(io(K::OutOfMemory)).into());
    errors.push(NotifyError::Socket(io(K::PermissionDenied)).into());
    for c in [
        ClientError::Connect(p("/run/loopd/loopd.ctl"), enoent()),
        ClientError::Io(p("/run/loopd/loopd.ctl"), io(K::ConnectionReset)),
        ClientError::NoReply,
        ClientError::Protocol("bad reply".into()),
    ] {
        errors.push(c.into());
    }
    errors.push(Classed::new("usage", "--max-connections must be at least 1").into());
    errors.push(UsageError("--name names one device".into()).into());
    let n = errors.len();
    assert!(n > 70, "only {n} errors");
    for e in &errors {
        let (text, _) = line(e);
        assert_eq!(loopd::text::repeated_cause(&text), None, "{text}");
        // Each cause's own text is in the line once at most.
        for c in e.chain() {
            let own = c.to_string();
            if own.len() >= 8 {
                assert!(text.matches(own.as_str()).count() <= 1, "{own:?} in {text}");
            }
        }
        assert_ne!(classify(e), "internal", "{text}");
    }
}

/// Issue 27: a usage error's one line keeps the arguments clap lists on
/// lines of their own.
#[test]
fn usage_message_keeps_the_missing_argument() {
    let text = "error: the following required arguments were not provided:\n  <NAME>\n\n\
                Usage: loopd status --json <NAME>\n\nFor more information, try '--help'.\n";
    assert_eq!(
        usage_message(text),
        "the following required arguments were not provided: <NAME>"
    );
    let text = "error: unexpected argument '--bogus' found\n\n  tip: to pass '--bogus' as a value, \
                use '-- --bogus'\n\nUsage: loopd list [OPTIONS]\n";
    assert_eq!(
        usage_message(text),
        "unexpected argument '--bogus' found; tip: to pass '--bogus' as a value, use '-- --bogus'"
    );
}
