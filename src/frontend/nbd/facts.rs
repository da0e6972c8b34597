//! A device as the handshake sees it ([`ExportFacts`]): what the handshake
//! tells a client about an export, and nothing else of the device.

use super::handshake::ExportFacts;
use crate::device::Device;

impl ExportFacts for Device {
    fn name(&self) -> &str {
        &self.name
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn strict_block_size(&self) -> bool {
        self.strict_block_size
    }
}
