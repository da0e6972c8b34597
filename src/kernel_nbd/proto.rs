//! The kernel `nbd` driver's generic-netlink protocol (linux/nbd-netlink.h,
//! drivers/block/nbd.c): request builders and reply decoders, pure functions
//! over bytes built on [`super::msg`].

use super::msg::{
    CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME, CTRL_ATTR_MCAST_GROUPS, CTRL_ATTR_MCAST_GRP_ID,
    CTRL_ATTR_MCAST_GRP_NAME, CTRL_CMD_GETFAMILY, GENL_ID_CTRL, Message, MsgBuilder, MsgError,
    NLM_F_ACK, NLM_F_REQUEST, find, parse_attrs, parse_datagram,
};

pub const NBD_GENL_FAMILY_NAME: &str = "nbd";
pub const NBD_GENL_VERSION: u8 = 1;
/// The multicast group on which the kernel announces `NBD_CMD_LINK_DEAD`.
pub const NBD_GENL_MCAST_GROUP_NAME: &str = "nbd_mc_group";

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

/// The id of multicast group `name` in a `CTRL_CMD_NEWFAMILY` reply's
/// attributes, if the family has that group.
pub fn parse_mcast_group(attrs: &[u8], name: &str) -> Result<Option<u32>, MsgError> {
    let attrs = parse_attrs(attrs)?;
    let Some(groups) = find(&attrs, CTRL_ATTR_MCAST_GROUPS) else {
        return Ok(None);
    };
    for g in parse_attrs(groups.payload)? {
        let fields = parse_attrs(g.payload)?;
        let is_it = match find(&fields, CTRL_ATTR_MCAST_GRP_NAME) {
            Some(n) => n.str()? == name,
            None => false,
        };
        if is_it {
            let id = find(&fields, CTRL_ATTR_MCAST_GRP_ID).ok_or(MsgError::Missing {
                ty: CTRL_ATTR_MCAST_GRP_ID,
            })?;
            return id.u32().map(Some);
        }
    }
    Ok(None)
}

/// The device indexes in the `NBD_CMD_LINK_DEAD` announcements of `family`
/// in one datagram read from a socket in the nbd multicast group.
pub fn parse_link_dead(datagram: &[u8], family: u16) -> Result<Vec<u32>, MsgError> {
    let mut out = Vec::new();
    for m in parse_datagram(datagram)? {
        let Message::Genl {
            msg_type,
            cmd,
            attrs,
            ..
        } = m
        else {
            continue;
        };
        if msg_type == family && cmd == NBD_CMD_LINK_DEAD {
            out.push(parse_connect_reply(attrs)?);
        }
    }
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_nbd::msg::{Attr, Message, parse_datagram};
    use proptest::prelude::*;

    fn genl_attrs(d: &[u8]) -> (u16, u8, Vec<u8>) {
        match &parse_datagram(d).unwrap()[..] {
            [
                Message::Genl {
                    msg_type,
                    cmd,
                    attrs,
                    ..
                },
            ] => (*msg_type, *cmd, attrs.to_vec()),
            other => panic!("not one genl message: {other:?}"),
        }
    }

    fn one<'a>(attrs: &[Attr<'a>], ty: u16) -> Attr<'a> {
        find(attrs, ty).unwrap_or_else(|| panic!("no attribute {ty}"))
    }

    fn socket_fds(a: &Attr<'_>) -> Vec<u32> {
        assert!(a.nested);
        parse_attrs(a.payload)
            .unwrap()
            .iter()
            .map(|item| {
                assert!(item.nested && item.ty == NBD_SOCK_ITEM);
                one(&parse_attrs(item.payload).unwrap(), NBD_SOCK_FD)
                    .u32()
                    .unwrap()
            })
            .collect()
    }

    proptest! {
        /// CONNECT carries every field given, the sockets as nested items in
        /// order, and nothing that was left out.
        #[test]
        fn connect_request_carries_what_was_asked(
            family in 0x10u16.., seq: u32, index: Option<u32>,
            size: u64, bs in 9u32..13, flags: u16, timeout: Option<u64>, dead: Option<u64>,
            fds in proptest::collection::vec(0u32..100_000, 1..8),
        ) {
            let a = DeviceAttrs {
                size_bytes: Some(size),
                block_size: Some(1 << bs),
                server_flags: Some(u64::from(flags)),
                client_flags: Some(0),
                timeout_secs: timeout,
                dead_conn_timeout_secs: dead,
                backend: Some("loopd:/img".into()),
            };
            let d = connect_request(family, seq, index, &a, &fds).unwrap();
            let (t, cmd, raw) = genl_attrs(&d);
            prop_assert_eq!((t, cmd), (family, NBD_CMD_CONNECT));
            let attrs = parse_attrs(&raw).unwrap();
            prop_assert_eq!(find(&attrs, NBD_ATTR_INDEX).map(|x| x.u32().unwrap()), index);
            prop_assert_eq!(one(&attrs, NBD_ATTR_SIZE_BYTES).u64().unwrap(), size);
            prop_assert_eq!(one(&attrs, NBD_ATTR_BLOCK_SIZE_BYTES).u64().unwrap(), 1u64 << bs);
            prop_assert_eq!(one(&attrs, NBD_ATTR_SERVER_FLAGS).u64().unwrap(), u64::from(flags));
            prop_assert_eq!(one(&attrs, NBD_ATTR_CLIENT_FLAGS).u64().unwrap(), 0);
            prop_assert_eq!(find(&attrs, NBD_ATTR_TIMEOUT).map(|x| x.u64().unwrap()), timeout);
            prop_assert_eq!(find(&attrs, NBD_ATTR_DEAD_CONN_TIMEOUT).map(|x| x.u64().unwrap()), dead);
            prop_assert_eq!(one(&attrs, NBD_ATTR_BACKEND_IDENTIFIER).str().unwrap(), "loopd:/img");
            prop_assert_eq!(socket_fds(&one(&attrs, NBD_ATTR_SOCKETS)), fds);
        }

        /// A STATUS reply of any device list decodes to that list.
        #[test]
        fn status_reply_decodes_every_device(
            devs in proptest::collection::vec((any::<u32>(), any::<bool>()), 0..40),
        ) {
            let mut b = MsgBuilder::genl(0x22, 0, 1, NBD_CMD_STATUS, 1);
            b.begin_nested(NBD_ATTR_DEVICE_LIST);
            for (i, c) in &devs {
                b.begin_nested(NBD_DEVICE_ITEM);
                b.u32(NBD_DEVICE_INDEX, *i).u8(NBD_DEVICE_CONNECTED, u8::from(*c));
                b.end_nested();
            }
            b.end_nested();
            let (_, _, raw) = genl_attrs(&b.finish().unwrap());
            let got = parse_status_reply(&raw).unwrap();
            let want: Vec<_> = devs.iter().map(|&(index, connected)| DeviceStatus { index, connected }).collect();
            prop_assert_eq!(got, want);
        }

        /// The reply decoders never panic on arbitrary attribute bytes.
        #[test]
        fn reply_decoders_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_status_reply(&data);
            let _ = parse_connect_reply(&data);
            let _ = parse_family_id(&data);
            let _ = parse_mcast_group(&data, NBD_GENL_MCAST_GROUP_NAME);
            let _ = parse_link_dead(&data, 0x22);
        }
    }

    #[test]
    fn reconfigure_names_the_index_and_leaves_out_server_flags() {
        let a = DeviceAttrs {
            server_flags: Some(1),
            dead_conn_timeout_secs: Some(60),
            ..DeviceAttrs::default()
        };
        let d = reconfigure_request(0x22, 1, 3, &a, &[5, 6]).unwrap();
        let (_, cmd, raw) = genl_attrs(&d);
        assert_eq!(cmd, NBD_CMD_RECONFIGURE);
        let attrs = parse_attrs(&raw).unwrap();
        assert_eq!(one(&attrs, NBD_ATTR_INDEX).u32().unwrap(), 3);
        assert!(find(&attrs, NBD_ATTR_SERVER_FLAGS).is_none());
        assert!(find(&attrs, NBD_ATTR_SIZE_BYTES).is_none());
        assert_eq!(one(&attrs, NBD_ATTR_DEAD_CONN_TIMEOUT).u64().unwrap(), 60);
        assert_eq!(socket_fds(&one(&attrs, NBD_ATTR_SOCKETS)), vec![5, 6]);
    }

    #[test]
    fn disconnect_and_status_requests() {
        let (_, cmd, raw) = genl_attrs(&disconnect_request(0x22, 1, 9).unwrap());
        assert_eq!(cmd, NBD_CMD_DISCONNECT);
        assert_eq!(
            one(&parse_attrs(&raw).unwrap(), NBD_ATTR_INDEX)
                .u32()
                .unwrap(),
            9
        );
        let (_, cmd, raw) = genl_attrs(&status_request(0x22, 1, None).unwrap());
        assert_eq!(cmd, NBD_CMD_STATUS);
        assert!(raw.is_empty());
    }

    #[test]
    fn family_request_and_reply() {
        let (t, cmd, raw) = genl_attrs(&get_family_request(1, "nbd").unwrap());
        assert_eq!((t, cmd), (GENL_ID_CTRL, CTRL_CMD_GETFAMILY));
        assert_eq!(
            one(&parse_attrs(&raw).unwrap(), CTRL_ATTR_FAMILY_NAME)
                .str()
                .unwrap(),
            "nbd"
        );
        let mut b = MsgBuilder::genl(GENL_ID_CTRL, 0, 1, 1, 2);
        b.str(CTRL_ATTR_FAMILY_NAME, "nbd")
            .u16(CTRL_ATTR_FAMILY_ID, 0x1a);
        let (_, _, raw) = genl_attrs(&b.finish().unwrap());
        assert_eq!(parse_family_id(&raw), Ok(0x1a));
    }

    fn family_reply(groups: &[(&str, u32)]) -> Vec<u8> {
        let mut b = MsgBuilder::genl(GENL_ID_CTRL, 0, 1, 1, 2);
        b.u16(CTRL_ATTR_FAMILY_ID, 0x1a);
        b.begin_nested(CTRL_ATTR_MCAST_GROUPS);
        for (i, (name, id)) in groups.iter().enumerate() {
            b.begin_nested(u16::try_from(i + 1).unwrap());
            b.u32(CTRL_ATTR_MCAST_GRP_ID, *id)
                .str(CTRL_ATTR_MCAST_GRP_NAME, name);
            b.end_nested();
        }
        b.end_nested();
        genl_attrs(&b.finish().unwrap()).2
    }

    #[test]
    fn mcast_group_is_found_by_name() {
        let raw = family_reply(&[("other", 3), (NBD_GENL_MCAST_GROUP_NAME, 9)]);
        assert_eq!(
            parse_mcast_group(&raw, NBD_GENL_MCAST_GROUP_NAME),
            Ok(Some(9))
        );
        assert_eq!(parse_mcast_group(&raw, "missing"), Ok(None));
        assert_eq!(parse_mcast_group(&family_reply(&[]), "x"), Ok(None));
    }

    #[test]
    fn link_dead_announcements_of_the_family_are_read() {
        let mut d = Vec::new();
        for (family, cmd, index) in [
            (0x22, NBD_CMD_LINK_DEAD, 4),
            (0x23, NBD_CMD_LINK_DEAD, 5),
            (0x22, NBD_CMD_STATUS, 6),
            (0x22, NBD_CMD_LINK_DEAD, 7),
        ] {
            let mut b = MsgBuilder::genl(family, 0, 0, cmd, 1);
            b.u32(NBD_ATTR_INDEX, index);
            d.extend(b.finish().unwrap());
        }
        assert_eq!(parse_link_dead(&d, 0x22), Ok(vec![4, 7]));
    }

    #[test]
    fn connect_reply_without_index_is_an_error() {
        assert_eq!(
            parse_connect_reply(&[]),
            Err(MsgError::Missing { ty: NBD_ATTR_INDEX })
        );
    }

    #[test]
    fn status_item_without_index_is_rejected() {
        let mut b = MsgBuilder::genl(0x22, 0, 1, NBD_CMD_STATUS, 1);
        b.begin_nested(NBD_ATTR_DEVICE_LIST);
        b.begin_nested(NBD_DEVICE_ITEM);
        b.u8(NBD_DEVICE_CONNECTED, 1);
        let (_, _, raw) = genl_attrs(&b.finish().unwrap());
        assert_eq!(
            parse_status_reply(&raw),
            Err(MsgError::Missing {
                ty: NBD_DEVICE_INDEX
            })
        );
    }
}
