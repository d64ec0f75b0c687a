//! Fake sysfs trees for the topology tests, shaped like the kernel's: `class/infiniband/NAME` is
//! a symlink into `devices/…`, a PCI device's `device` link leads to its PCI function directory
//! (which holds `numa_node`), and a software device (rxe) sits under `devices/virtual` without one.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// One port as the tree shows it. `ndevs[i]` is GID entry `i`'s netdev; `None` is an
/// unpopulated entry (a directory here, so reading it fails as the kernel's EINVAL does).
pub struct PortSpec<'a> {
    pub state: &'a str,
    pub link_layer: &'a str,
    pub rate: &'a str,
    pub ndevs: Vec<Option<&'a str>>,
}

impl<'a> PortSpec<'a> {
    pub fn roce(state: &'a str, rate: &'a str, netdev: &'a str) -> Self {
        // A RoCE port has several GIDs per netdev (link-local and IPv4, v1 and v2).
        PortSpec { state, link_layer: "Ethernet", rate, ndevs: vec![Some(netdev), Some(netdev), Some(netdev), Some(netdev), None, None] }
    }
}

/// A sysfs tree in a temporary directory, removed when dropped.
pub struct FakeSysfs {
    dir: tempfile::TempDir,
}

impl FakeSysfs {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("class/infiniband")).unwrap();
        FakeSysfs { dir }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// A device on PCI function `pci` of NUMA node `numa_node` (-1: none); returns its directory.
    pub fn pci_device(&self, name: &str, pci: &str, numa_node: i32) -> PathBuf {
        let function = self.root().join("devices/pci0000:00").join(pci);
        write(&function.join("numa_node"), format!("{numa_node}\n"));
        let dev = function.join("infiniband").join(name);
        fs::create_dir_all(&dev).unwrap();
        symlink(format!("../../devices/pci0000:00/{pci}/infiniband/{name}"), self.class_entry(name)).unwrap();
        symlink("../../../".to_string() + pci, dev.join("device")).unwrap();
        dev
    }

    /// A software device (rxe, siw): no parent, so no `device` link.
    pub fn virtual_device(&self, name: &str) -> PathBuf {
        let dev = self.root().join("devices/virtual/infiniband").join(name);
        fs::create_dir_all(&dev).unwrap();
        symlink(format!("../../devices/virtual/infiniband/{name}"), self.class_entry(name)).unwrap();
        dev
    }

    pub fn class_entry(&self, name: &str) -> PathBuf {
        self.root().join("class/infiniband").join(name)
    }

    /// Port `port` of the device in `dev`; returns the port's directory.
    pub fn port(&self, dev: &Path, port: u32, spec: &PortSpec) -> PathBuf {
        let dir = dev.join("ports").join(port.to_string());
        write(&dir.join("state"), format!("{}\n", spec.state));
        write(&dir.join("link_layer"), format!("{}\n", spec.link_layer));
        write(&dir.join("rate"), format!("{}\n", spec.rate));
        let ndevs = dir.join("gid_attrs/ndevs");
        fs::create_dir_all(&ndevs).unwrap();
        for (index, netdev) in spec.ndevs.iter().enumerate() {
            match netdev {
                Some(n) => write(&ndevs.join(index.to_string()), format!("{n}\n")),
                None => fs::create_dir_all(ndevs.join(index.to_string())).unwrap(),
            }
        }
        dir
    }
}

/// Writes `content` to `path`, creating its directories.
pub fn write(path: &Path, content: impl AsRef<[u8]>) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
}
