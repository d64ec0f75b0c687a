//! Test support for the ring's unit tests: a writer and a reader over two mappings of one file,
//! as the agent and an application have them.
use std::io::Write;

use super::layout::ring_len;
use super::reader::RingReader;
use super::writer::RingWriter;
use crate::memory::RegionMemory;

/// A writer and a reader over two mappings of one file (kept alive by the returned handle).
pub(super) fn pair(slots: u32, slot_size: u32) -> (RingWriter, RingReader, tempfile::NamedTempFile) {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    let len = ring_len(slots, slot_size);
    f.write_all(&vec![0u8; len as usize]).unwrap();
    let w = RingWriter::create(RegionMemory::map_file(f.as_file(), len as usize, true).unwrap(), slots, slot_size).unwrap();
    let r = RingReader::open(RegionMemory::map_file(f.as_file(), len as usize, true).unwrap()).unwrap();
    (w, r, f)
}
