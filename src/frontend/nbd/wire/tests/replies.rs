//! Reply encodings: simple and structured reply headers, read and error
//! chunks, block status headers, option replies.

use super::*;

pub(super) const ALL_ERRNOS: [NbdErrno; 8] = [
    NbdErrno::Perm,
    NbdErrno::Io,
    NbdErrno::NoMem,
    NbdErrno::Inval,
    NbdErrno::NoSpc,
    NbdErrno::Overflow,
    NbdErrno::NotSup,
    NbdErrno::Shutdown,
];

proptest! {
    #[test]
    fn simple_reply_header_is_16_bytes_with_magic_errno_and_cookie(
        cmd_is_read in any::<bool>(),
        cookie in any::<u64>(),
        offset in any::<u64>(),
        result in prop_oneof![
            (0u32..=MAX_PAYLOAD).prop_map(Ok),
            prop::sample::select(ALL_ERRNOS.to_vec()).prop_map(Err),
        ],
    ) {
        let mut out = [0xaau8; MAX_REPLY_HEADER];
        let n = reply_header(&mut out, cmd_is_read, Replies::Simple, cookie, offset, result);
        prop_assert_eq!(n, SIMPLE_REPLY_LEN);
        prop_assert_eq!(be32_at(&out, 0), SIMPLE_REPLY_MAGIC);
        prop_assert_eq!(SIMPLE_REPLY_MAGIC, 0x6744_6698);
        prop_assert_eq!(be32_at(&out, 4), result.err().map_or(0, error_code));
        prop_assert_eq!(be64_at(&out, 8), cookie);
    }

    #[test]
    fn structured_read_chunk_is_28_bytes_with_length_data_plus_8(
        cookie in any::<u64>(),
        offset in any::<u64>(),
        data_len in 0u32..=MAX_PAYLOAD,
    ) {
        let mut out = [0u8; MAX_REPLY_HEADER];
        let n = reply_header(&mut out, true, Replies::Structured, cookie, offset, Ok(data_len));
        prop_assert_eq!(n, 28);
        prop_assert_eq!(be32_at(&out, 0), STRUCTURED_REPLY_MAGIC);
        prop_assert_eq!(u16::from_be_bytes([out[4], out[5]]), REPLY_FLAG_DONE);
        prop_assert_eq!(u16::from_be_bytes([out[6], out[7]]), REPLY_TYPE_OFFSET_DATA);
        prop_assert_eq!(be64_at(&out, 8), cookie);
        prop_assert_eq!(be32_at(&out, 16), data_len + 8);
        prop_assert_eq!(be64_at(&out, 20), offset);
    }

    #[test]
    fn structured_error_chunk_carries_the_errno_and_an_empty_message(
        cmd_is_read in any::<bool>(),
        cookie in any::<u64>(),
        e in prop::sample::select(ALL_ERRNOS.to_vec()),
    ) {
        let mut out = [0u8; MAX_REPLY_HEADER];
        let n = reply_header(&mut out, cmd_is_read, Replies::Structured, cookie, 0, Err(e));
        prop_assert_eq!(n, 26);
        prop_assert_eq!(be32_at(&out, 0), STRUCTURED_REPLY_MAGIC);
        prop_assert_eq!(u16::from_be_bytes([out[4], out[5]]), REPLY_FLAG_DONE);
        prop_assert_eq!(u16::from_be_bytes([out[6], out[7]]), REPLY_TYPE_ERROR);
        prop_assert_eq!(be64_at(&out, 8), cookie);
        // Length covers errno (4) and message length (2): the bytes that follow the header.
        prop_assert_eq!(be32_at(&out, 16) as usize, n - CHUNK_HEADER_LEN);
        prop_assert_eq!(be32_at(&out, 20), error_code(e));
        prop_assert_eq!(u16::from_be_bytes([out[24], out[25]]), 0);
    }

    #[test]
    fn structured_non_read_success_is_a_simple_reply(cookie in any::<u64>(), v in any::<u32>()) {
        let mut out = [0u8; MAX_REPLY_HEADER];
        let n = reply_header(&mut out, false, Replies::Structured, cookie, 0, Ok(v));
        prop_assert_eq!(n, SIMPLE_REPLY_LEN);
        prop_assert_eq!(be32_at(&out, 0), SIMPLE_REPLY_MAGIC);
        prop_assert_eq!(be32_at(&out, 4), 0);
        prop_assert_eq!(be64_at(&out, 8), cookie);
    }

    #[test]
    fn block_status_header_length_counts_context_and_descriptors(
        cookie in any::<u64>(),
        context in any::<u32>(),
        n in 0u32..(1 << 20),
    ) {
        let mut out = [0u8; MAX_REPLY_HEADER];
        let len = block_status_header(&mut out, cookie, context, n);
        prop_assert_eq!(len, 24);
        prop_assert_eq!(be32_at(&out, 0), STRUCTURED_REPLY_MAGIC);
        prop_assert_eq!(u16::from_be_bytes([out[6], out[7]]), REPLY_TYPE_BLOCK_STATUS);
        prop_assert_eq!(be64_at(&out, 8), cookie);
        prop_assert_eq!(be32_at(&out, 16), 4 + 8 * n);
        prop_assert_eq!(be32_at(&out, 20), context);
    }

    #[test]
    fn option_reply_has_magic_option_type_and_length(
        option in any::<u32>(),
        reply in any::<u32>(),
        payload in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut out = vec![1, 2, 3];
        option_reply(&mut out, option, reply, &payload);
        prop_assert_eq!(&out[..3], &[1u8, 2, 3][..]);
        let o = &out[3..];
        prop_assert_eq!(o.len(), 20 + payload.len());
        prop_assert_eq!(be64_at(o, 0), OPT_REPLY_MAGIC);
        prop_assert_eq!(be32_at(o, 8), option);
        prop_assert_eq!(be32_at(o, 12), reply);
        prop_assert_eq!(be32_at(o, 16) as usize, payload.len());
        prop_assert_eq!(&o[20..], &payload[..]);
    }

    #[test]
    fn rep_server_is_a_length_prefixed_name(name in arb_name()) {
        let b = rep_server(&name);
        prop_assert_eq!(be32_at(&b, 0) as usize, name.len());
        prop_assert_eq!(&b[4..], name.as_bytes());
    }
}
