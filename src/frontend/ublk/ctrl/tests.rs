use super::*;

fn params() -> DeviceParams {
    DeviceParams {
        dev_bytes: 64 << 20,
        logical_block: 512,
        physical_block: 4096,
        io_opt: 0,
        max_io_bytes: 512 << 10,
        max_discard_bytes: 0,
        max_write_zeroes_bytes: 0,
        read_only: false,
        rotational: false,
        volatile_cache: true,
        fua: true,
    }
}

#[test]
fn missing_control_device_says_modprobe() {
    let dir = tempfile::tempdir().unwrap();
    let err = UblkCtrl::open_at(&dir.path().join("ublk-control")).unwrap_err();
    assert!(matches!(err, CtrlError::NotAvailable { .. }));
    assert!(err.to_string().contains("modprobe ublk_drv"), "{err}");
}

#[test]
fn add_dev_limit_names_ublks_max() {
    let err = CtrlError::Command {
        cmd: Cmd::AddDev,
        dev_id: u32::MAX,
        errno: libc::EACCES,
        hint: hint(Cmd::AddDev, libc::EACCES),
    };
    let msg = err.to_string();
    assert!(
        msg.starts_with("ublk ADD_DEV of device (any id) failed: Permission denied"),
        "{msg}"
    );
    assert!(msg.contains("ublks_max"), "{msg}");
}

#[test]
fn params_encode_shifts_and_sectors() {
    let p = params().to_uapi().unwrap();
    assert_eq!(p.types, UBLK_PARAM_TYPE_BASIC);
    assert_eq!(p.basic.logical_bs_shift, 9);
    assert_eq!(p.basic.physical_bs_shift, 12);
    assert_eq!(p.basic.max_sectors, 1024);
    assert_eq!(p.basic.dev_sectors, 131_072);
    assert_eq!(p.basic.attrs, UBLK_ATTR_VOLATILE_CACHE | UBLK_ATTR_FUA);
    assert_eq!(p.len, 112);
}

#[test]
fn discard_limits_add_the_discard_type_with_one_segment() {
    let p = DeviceParams {
        max_discard_bytes: 1 << 30,
        max_write_zeroes_bytes: 1 << 30,
        ..params()
    }
    .to_uapi()
    .unwrap();
    assert_eq!(p.types, UBLK_PARAM_TYPE_BASIC | UBLK_PARAM_TYPE_DISCARD);
    assert_eq!(p.discard.max_discard_segments, 1);
    assert_eq!(p.discard.discard_granularity, 4096);
    assert_eq!(p.discard.max_write_zeroes_sectors, 2 << 20);
}

#[test]
fn bad_params_are_refused_before_the_kernel_sees_them() {
    for bad in [
        DeviceParams {
            logical_block: 8192,
            physical_block: 8192,
            ..params()
        },
        DeviceParams {
            logical_block: 1000,
            ..params()
        },
        DeviceParams {
            physical_block: 256,
            ..params()
        },
        DeviceParams {
            dev_bytes: 1000,
            ..params()
        },
        DeviceParams {
            volatile_cache: false,
            ..params()
        },
    ] {
        assert!(bad.to_uapi().is_err(), "{bad:?}");
    }
    assert!(
        AddDev {
            queue_depth: 0,
            ..AddDev::default()
        }
        .dev_info()
        .is_err()
    );
    assert!(
        AddDev {
            max_io_buf_bytes: 1000,
            ..AddDev::default()
        }
        .dev_info()
        .is_err()
    );
}

#[test]
fn add_dev_sets_ioctl_encode_and_recovery_flags() {
    let i = AddDev {
        user_recovery: true,
        reissue: true,
        ..AddDev::default()
    }
    .dev_info()
    .unwrap();
    assert_eq!(
        i.flags,
        UBLK_F_CMD_IOCTL_ENCODE | UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE
    );
    assert_eq!(i.dev_id, u32::MAX);
}
