//! Test-only faults, compiled only with the `vm-tests` feature (never in a
//! release build): `LOOPD_TEST_UBLK_NO_FETCH=NAME` in the daemon's
//! environment makes queue 0 of the device named NAME skip the FETCH_REQ of
//! tag 0, as a queue that never fetches would: START_DEV then waits in the
//! kernel forever, and only the control command's deadline ends the attach.
//! The skipped tag counts as aborted, so the queue still ends once STOP_DEV
//! aborts its other fetches.

/// Whether the queue `q_id` of device `name` skips the fetch of `tag`.
pub fn skip_fetch(name: &str, q_id: u16, tag: u16) -> bool {
    q_id == 0 && tag == 0 && std::env::var_os("LOOPD_TEST_UBLK_NO_FETCH").is_some_and(|v| v == name)
}
