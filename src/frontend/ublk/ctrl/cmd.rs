//! The control commands of [`super::UblkCtrl`]: their names (for errors),
//! their ioctl-encoded opcodes, and the hint an error of each gets. Pure data;
//! nothing here talks to the kernel.

use crate::frontend::ublk::sys::{
    UBLK_U_CMD_ADD_DEV, UBLK_U_CMD_DEL_DEV, UBLK_U_CMD_DEL_DEV_ASYNC, UBLK_U_CMD_END_USER_RECOVERY,
    UBLK_U_CMD_GET_DEV_INFO, UBLK_U_CMD_GET_FEATURES, UBLK_U_CMD_GET_PARAMS,
    UBLK_U_CMD_QUIESCE_DEV, UBLK_U_CMD_SET_PARAMS, UBLK_U_CMD_START_DEV,
    UBLK_U_CMD_START_USER_RECOVERY, UBLK_U_CMD_STOP_DEV, UBLK_U_CMD_TRY_STOP_DEV,
    UBLK_U_CMD_UPDATE_SIZE,
};

/// The control commands, for error messages and hints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmd {
    AddDev,
    SetParams,
    GetParams,
    StartDev,
    StopDev,
    DelDev,
    DelDevAsync,
    GetDevInfo,
    GetFeatures,
    StartUserRecovery,
    EndUserRecovery,
    UpdateSize,
    QuiesceDev,
    TryStopDev,
}

impl Cmd {
    fn name(self) -> &'static str {
        match self {
            Cmd::AddDev => "ADD_DEV",
            Cmd::SetParams => "SET_PARAMS",
            Cmd::GetParams => "GET_PARAMS",
            Cmd::StartDev => "START_DEV",
            Cmd::StopDev => "STOP_DEV",
            Cmd::DelDev => "DEL_DEV",
            Cmd::DelDevAsync => "DEL_DEV_ASYNC",
            Cmd::GetDevInfo => "GET_DEV_INFO",
            Cmd::GetFeatures => "GET_FEATURES",
            Cmd::StartUserRecovery => "START_USER_RECOVERY",
            Cmd::EndUserRecovery => "END_USER_RECOVERY",
            Cmd::UpdateSize => "UPDATE_SIZE",
            Cmd::QuiesceDev => "QUIESCE_DEV",
            Cmd::TryStopDev => "TRY_STOP_DEV",
        }
    }

    pub(super) fn op(self) -> u32 {
        match self {
            Cmd::AddDev => UBLK_U_CMD_ADD_DEV,
            Cmd::SetParams => UBLK_U_CMD_SET_PARAMS,
            Cmd::GetParams => UBLK_U_CMD_GET_PARAMS,
            Cmd::StartDev => UBLK_U_CMD_START_DEV,
            Cmd::StopDev => UBLK_U_CMD_STOP_DEV,
            Cmd::DelDev => UBLK_U_CMD_DEL_DEV,
            Cmd::DelDevAsync => UBLK_U_CMD_DEL_DEV_ASYNC,
            Cmd::GetDevInfo => UBLK_U_CMD_GET_DEV_INFO,
            Cmd::GetFeatures => UBLK_U_CMD_GET_FEATURES,
            Cmd::StartUserRecovery => UBLK_U_CMD_START_USER_RECOVERY,
            Cmd::EndUserRecovery => UBLK_U_CMD_END_USER_RECOVERY,
            Cmd::UpdateSize => UBLK_U_CMD_UPDATE_SIZE,
            Cmd::QuiesceDev => UBLK_U_CMD_QUIESCE_DEV,
            Cmd::TryStopDev => UBLK_U_CMD_TRY_STOP_DEV,
        }
    }
}

impl std::fmt::Display for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a failed command's errno means for the user (6.12 driver).
pub(super) fn hint(cmd: Cmd, errno: i32) -> &'static str {
    match (cmd, errno) {
        (Cmd::AddDev, libc::EACCES) => {
            " (the ublk_drv device limit is reached: raise the module parameter ublks_max, \
             /sys/module/ublk_drv/parameters/ublks_max, or delete unused ublk devices)"
        }
        (Cmd::AddDev, libc::ENOSPC) => " (no free ublk device id: delete unused ublk devices)",
        (Cmd::AddDev, libc::EPERM) => " (adding a ublk device needs CAP_SYS_ADMIN: run as root)",
        (Cmd::AddDev, libc::EEXIST) => {
            " (that ublk device id is taken: pick another or let the kernel choose)"
        }
        (Cmd::StartDev, libc::EEXIST) => " (the device is already started)",
        (Cmd::TryStopDev, libc::EBUSY) => " (the disk is open: unmount or close it first)",
        (Cmd::QuiesceDev, libc::EBUSY) => {
            " (requests in flight did not finish within the time given)"
        }
        (Cmd::StartUserRecovery, libc::EBUSY) => {
            " (the device is not quiesced yet: the old server's /dev/ublkcN and rings must be closed first)"
        }
        (_, libc::ENODEV) | (_, libc::ENOENT) => " (no such ublk device)",
        (_, libc::EPERM) | (_, libc::EACCES) => {
            " (permission denied: ublk control needs CAP_SYS_ADMIN)"
        }
        (_, libc::EOPNOTSUPP) => " (this kernel's ublk_drv does not support it)",
        _ => "",
    }
}
