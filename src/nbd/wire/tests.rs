use super::*;

#[test]
fn request_round_trips() {
    let r = Request {
        flags: 1,
        kind: CMD_WRITE,
        cookie: 7,
        offset: 4096,
        len: 512,
    };
    assert_eq!(parse_request(&encode_request(&r)), Ok(r));
}
