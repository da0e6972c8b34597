//! A device as the handshake sees it ([`ExportFacts`]): what the handshake
//! tells a client about an export, and nothing else of the device.

use super::handshake::ExportFacts;
use crate::device::Device;

// Each names the device's own accessor (an inherent method, which a bare
// `self.name()` would reach too; spelled out so no reader takes it for
// recursion).
impl ExportFacts for Device {
    fn name(&self) -> &str {
        Device::name(self)
    }
    fn size(&self) -> u64 {
        Device::size(self)
    }
    fn read_only(&self) -> bool {
        Device::read_only(self)
    }
    fn block_size(&self) -> u32 {
        Device::block_size(self)
    }
    fn strict_block_size(&self) -> bool {
        Device::strict_block_size(self)
    }
}
