//! Where the node's RDMA devices sit: facts read from plain files (sysfs, `/proc/self/numa_maps`)
//! and the local interfaces' IPv4 subnets.
//!
//! Nothing here needs an RDMA device or the `verbs` feature: the readers take their root or text
//! as a parameter, so the tests build fake trees and run on any host.
//!
//! * [`sysfs`] — each device's NUMA node and PCI address, each port's state, link layer, rate and
//!   netdevs.
//! * [`numa_maps`] — the NUMA node holding most of a region's pages.
//! * [`device_info`] — the sysfs facts and the selected GID's subnet added to a
//!   [`crate::DeviceInfo`] (matched by name and port).
//! * [`net`] — prefix length of a local IPv4 address, and whether two addresses share a subnet
//!   (how reachability between devices is decided).

pub mod device_info;
pub mod net;
pub mod numa_maps;
pub mod sysfs;

#[cfg(test)]
mod fake_sysfs;
#[cfg(test)]
mod sysfs_tests;
