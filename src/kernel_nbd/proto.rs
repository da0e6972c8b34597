//! The kernel `nbd` driver's generic-netlink protocol (linux/nbd-netlink.h,
//! drivers/block/nbd.c): request builders and reply decoders, pure functions
//! over bytes built on [`super::msg`].

use super::msg::{
    CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME, CTRL_CMD_GETFAMILY, GENL_ID_CTRL, MsgBuilder,
    MsgError, NLM_F_ACK, NLM_F_REQUEST, find, parse_attrs,
};

pub const NBD_GENL_FAMILY_NAME: &str = "nbd";
pub const NBD_GENL_VERSION: u8 = 1;

pub const NBD_CMD_CONNECT: u8 = 1;
pub const NBD_CMD_DISCONNECT: u8 = 2;
pub const NBD_CMD_RECONFIGURE: u8 = 3;
pub const NBD_CMD_LINK_DEAD: u8 = 4;
pub const NBD_CMD_STATUS: u8 = 5;

pub const NBD_ATTR_INDEX: u16 = 1; // u32
pub const NBD_ATTR_SIZE_BYTES: u16 = 2; // u64
pub const NBD_ATTR_BLOCK_SIZE_BYTES: u16 = 3; // u64
pub const NBD_ATTR_TIMEOUT: u16 = 4; // u64, seconds
pub const NBD_ATTR_SERVER_FLAGS: u16 = 5; // u64, NBD transmission flags
pub const NBD_ATTR_CLIENT_FLAGS: u16 = 6; // u64, NBD_CFLAG_*
pub const NBD_ATTR_SOCKETS: u16 = 7; // nested NBD_SOCK_ITEMs
pub const NBD_ATTR_DEAD_CONN_TIMEOUT: u16 = 8; // u64, seconds
pub const NBD_ATTR_DEVICE_LIST: u16 = 9; // nested NBD_DEVICE_ITEMs
pub const NBD_ATTR_BACKEND_IDENTIFIER: u16 = 10; // string

pub const NBD_SOCK_ITEM: u16 = 1;
pub const NBD_SOCK_FD: u16 = 1; // u32

pub const NBD_DEVICE_ITEM: u16 = 1;
pub const NBD_DEVICE_INDEX: u16 = 1; // u32
pub const NBD_DEVICE_CONNECTED: u16 = 2; // u8

/// Remove the device node when it is disconnected.
pub const NBD_CFLAG_DESTROY_ON_DISCONNECT: u64 = 1 << 0;
/// Disconnect when the last opener of the block device closes it.
pub const NBD_CFLAG_DISCONNECT_ON_CLOSE: u64 = 1 << 1;

/// Everything `NBD_CMD_CONNECT` and `NBD_CMD_RECONFIGURE` can carry besides
/// the index and the sockets. `None` leaves the kernel's value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceAttrs {
    pub size_bytes: Option<u64>,
    pub block_size: Option<u32>,
    /// The export's NBD transmission flags (`NBD_FLAG_*`), as the handshake
    /// sends them; the kernel reads READ_ONLY, SEND_FLUSH, SEND_FUA,
    /// SEND_TRIM, SEND_WRITE_ZEROES, ROTATIONAL and CAN_MULTI_CONN. Connect only.
    pub server_flags: Option<u64>,
    pub client_flags: Option<u64>,
    /// Seconds before a request is timed out (then retried on a live
    /// connection, or waited for under the dead-connection timeout).
    pub timeout_secs: Option<u64>,
    /// Seconds a request waits for a dead connection to be replaced.
    pub dead_conn_timeout_secs: Option<u64>,
    /// Shown in `/sys/block/nbdN/backend`; once set, a reconfigure must name it.
    pub backend: Option<String>,
}

/// What `NBD_CMD_STATUS` says about one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceStatus {
    pub index: u32,
    pub connected: bool,
}

/// `CTRL_CMD_GETFAMILY` for `name`.
pub fn get_family_request(seq: u32, name: &str) -> Result<Vec<u8>, MsgError> {
    let mut b = MsgBuilder::genl(
        GENL_ID_CTRL,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        CTRL_CMD_GETFAMILY,
        1,
    );
    b.str(CTRL_ATTR_FAMILY_NAME, name);
    b.finish()
}

/// The family id in a `CTRL_CMD_NEWFAMILY` reply's attributes.
pub fn parse_family_id(attrs: &[u8]) -> Result<u16, MsgError> {
    let attrs = parse_attrs(attrs)?;
    find(&attrs, CTRL_ATTR_FAMILY_ID)
        .ok_or(MsgError::Missing {
            ty: CTRL_ATTR_FAMILY_ID,
        })?
        .u16()
}

fn nbd_request(family: u16, seq: u32, cmd: u8) -> MsgBuilder {
    MsgBuilder::genl(
        family,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        cmd,
        NBD_GENL_VERSION,
    )
}

fn put_device_attrs(b: &mut MsgBuilder, a: &DeviceAttrs, connect: bool) {
    if let Some(v) = a.size_bytes {
        b.u64(NBD_ATTR_SIZE_BYTES, v);
    }
    if let Some(v) = a.block_size {
        b.u64(NBD_ATTR_BLOCK_SIZE_BYTES, u64::from(v));
    }
    if let Some(v) = a.timeout_secs {
        b.u64(NBD_ATTR_TIMEOUT, v);
    }
    if let Some(v) = a.dead_conn_timeout_secs {
        b.u64(NBD_ATTR_DEAD_CONN_TIMEOUT, v);
    }
    if let (true, Some(v)) = (connect, a.server_flags) {
        b.u64(NBD_ATTR_SERVER_FLAGS, v);
    }
    if let Some(v) = a.client_flags {
        b.u64(NBD_ATTR_CLIENT_FLAGS, v);
    }
    if let Some(s) = &a.backend {
        b.str(NBD_ATTR_BACKEND_IDENTIFIER, s);
    }
}

fn put_sockets(b: &mut MsgBuilder, fds: &[u32]) {
    b.begin_nested(NBD_ATTR_SOCKETS);
    for &fd in fds {
        b.begin_nested(NBD_SOCK_ITEM);
        b.u32(NBD_SOCK_FD, fd);
        b.end_nested();
    }
    b.end_nested();
}

/// `NBD_CMD_CONNECT`: `index` `None` lets the kernel pick (or add) a device.
pub fn connect_request(
    family: u16,
    seq: u32,
    index: Option<u32>,
    attrs: &DeviceAttrs,
    fds: &[u32],
) -> Result<Vec<u8>, MsgError> {
    let mut b = nbd_request(family, seq, NBD_CMD_CONNECT);
    if let Some(i) = index {
        b.u32(NBD_ATTR_INDEX, i);
    }
    put_device_attrs(&mut b, attrs, true);
    put_sockets(&mut b, fds);
    b.finish()
}

/// `NBD_CMD_RECONFIGURE`: each socket replaces one dead connection of `index`.
pub fn reconfigure_request(
    family: u16,
    seq: u32,
    index: u32,
    attrs: &DeviceAttrs,
    fds: &[u32],
) -> Result<Vec<u8>, MsgError> {
    let mut b = nbd_request(family, seq, NBD_CMD_RECONFIGURE);
    b.u32(NBD_ATTR_INDEX, index);
    put_device_attrs(&mut b, attrs, false);
    if !fds.is_empty() {
        put_sockets(&mut b, fds);
    }
    b.finish()
}

pub fn disconnect_request(family: u16, seq: u32, index: u32) -> Result<Vec<u8>, MsgError> {
    let mut b = nbd_request(family, seq, NBD_CMD_DISCONNECT);
    b.u32(NBD_ATTR_INDEX, index);
    b.finish()
}

/// `NBD_CMD_STATUS` of one device, or of every device with `None`.
pub fn status_request(family: u16, seq: u32, index: Option<u32>) -> Result<Vec<u8>, MsgError> {
    let mut b = nbd_request(family, seq, NBD_CMD_STATUS);
    if let Some(i) = index {
        b.u32(NBD_ATTR_INDEX, i);
    }
    b.finish()
}

/// The device index in the reply to `NBD_CMD_CONNECT`.
pub fn parse_connect_reply(attrs: &[u8]) -> Result<u32, MsgError> {
    let attrs = parse_attrs(attrs)?;
    find(&attrs, NBD_ATTR_INDEX)
        .ok_or(MsgError::Missing { ty: NBD_ATTR_INDEX })?
        .u32()
}

/// The devices in the reply to `NBD_CMD_STATUS`, in the kernel's order.
pub fn parse_status_reply(attrs: &[u8]) -> Result<Vec<DeviceStatus>, MsgError> {
    let attrs = parse_attrs(attrs)?;
    let list = find(&attrs, NBD_ATTR_DEVICE_LIST).ok_or(MsgError::Missing {
        ty: NBD_ATTR_DEVICE_LIST,
    })?;
    let mut out = Vec::new();
    for item in parse_attrs(list.payload)? {
        if item.ty != NBD_DEVICE_ITEM {
            continue;
        }
        let fields = parse_attrs(item.payload)?;
        let index = find(&fields, NBD_DEVICE_INDEX)
            .ok_or(MsgError::Missing {
                ty: NBD_DEVICE_INDEX,
            })?
            .u32()?;
        let connected = match find(&fields, NBD_DEVICE_CONNECTED) {
            Some(a) => a.u8()? != 0,
            None => false,
        };
        out.push(DeviceStatus { index, connected });
    }
    Ok(out)
}
