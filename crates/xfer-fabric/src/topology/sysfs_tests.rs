//! [`super::sysfs::read_devices`] over whole fake trees: a two-socket server with eight NICs,
//! Soft-RoCE devices on veths, and hostile trees.

use std::fs;
use std::os::unix::fs::symlink;

use super::fake_sysfs::{write, FakeSysfs, PortSpec};
use super::sysfs::{read_device, read_devices, DeviceTopo, PortTopo};

const HDR: &str = "200 Gb/sec (4X HDR)";

fn roce_port(state: &str, netdev: &str) -> PortTopo {
    PortTopo {
        port: 1,
        state: state.to_string(),
        link_layer: "Ethernet".to_string(),
        rate_mbps: Some(200_000),
        netdevs: vec![netdev.to_string()],
    }
}

#[test]
fn two_socket_server_with_eight_nics() {
    let sys = FakeSysfs::new();
    let buses = ["0c", "12", "38", "3d", "8a", "90", "b8", "bd"];
    // Created out of order: the listing sorts by name whatever the directory order.
    for i in [7, 3, 0, 5, 1, 6, 2, 4] {
        let node = if i < 4 { 0 } else { 1 };
        let dev = sys.pci_device(&format!("mlx5_{i}"), &format!("0000:{}:00.0", buses[i]), node);
        let state = if i == 5 { "1: DOWN" } else { "4: ACTIVE" };
        sys.port(&dev, 1, &PortSpec::roce(state, HDR, &format!("ens{i}np0")));
    }
    let devices = read_devices(sys.root());
    let expected: Vec<DeviceTopo> = (0..8)
        .map(|i| DeviceTopo {
            name: format!("mlx5_{i}"),
            numa_node: Some(if i < 4 { 0 } else { 1 }),
            pci_address: Some(format!("0000:{}:00.0", buses[i])),
            ports: vec![roce_port(if i == 5 { "DOWN" } else { "ACTIVE" }, &format!("ens{i}np0"))],
        })
        .collect();
    assert_eq!(devices, expected);
}

#[test]
fn ten_devices_sort_numerically_and_ports_by_number() {
    let sys = FakeSysfs::new();
    for i in 0..11 {
        sys.pci_device(&format!("mlx5_{i}"), &format!("0000:{:02x}:00.0", i + 1), 0);
    }
    let dev = sys.pci_device("mlx4_0", "0000:40:00.0", -1);
    for port in [2, 1] {
        sys.port(&dev, port, &PortSpec { state: "4: ACTIVE", link_layer: "InfiniBand", rate: "56 Gb/sec (4X FDR)", ndevs: vec![] });
    }
    let devices = read_devices(sys.root());
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names[..4], ["mlx4_0", "mlx5_0", "mlx5_1", "mlx5_2"]);
    assert_eq!(names.last(), Some(&"mlx5_10"));
    let mlx4 = &devices[0];
    assert_eq!(mlx4.numa_node, None, "numa_node -1 is no node");
    assert_eq!(mlx4.pci_address.as_deref(), Some("0000:40:00.0"));
    assert_eq!(mlx4.ports.iter().map(|p| p.port).collect::<Vec<_>>(), [1, 2]);
    assert!(mlx4.ports.iter().all(|p| p.link_layer == "InfiniBand" && p.rate_mbps == Some(56_000) && p.netdevs.is_empty()));
    assert!(devices[1].ports.is_empty(), "a device without ports/ has none");
}

#[test]
fn soft_roce_on_veths_has_no_node_and_no_pci_address() {
    let sys = FakeSysfs::new();
    for (name, veth) in [("rxe1", "veth1"), ("rxe0", "veth0")] {
        let dev = sys.virtual_device(name);
        sys.port(&dev, 1, &PortSpec::roce("4: ACTIVE", "10 Gb/sec (1X QDR)", veth));
    }
    let devices = read_devices(sys.root());
    assert_eq!(devices.len(), 2);
    for (d, veth) in devices.iter().zip(["veth0", "veth1"]) {
        assert_eq!((d.numa_node, d.pci_address.as_deref()), (None, None), "{}", d.name);
        assert_eq!(d.ports.len(), 1);
        assert_eq!(d.ports[0].netdevs, [veth]);
        assert_eq!(d.ports[0].rate_mbps, Some(10_000));
        assert_eq!(d.ports[0].state, "ACTIVE");
    }
    assert_eq!(devices[0].name, "rxe0");
}

#[test]
fn netdevs_keep_gid_index_order_without_duplicates() {
    let sys = FakeSysfs::new();
    let dev = sys.virtual_device("rxe0");
    let ndevs = vec![Some("b0"), None, Some("a0"), Some("b0"), Some(""), Some("a0"), Some("c0")];
    sys.port(&dev, 1, &PortSpec { state: "4: ACTIVE", link_layer: "Ethernet", rate: "10 Gb/sec", ndevs });
    // Index 10 sorts before 2 as text but comes after it as a GID index.
    write(&dev.join("ports/1/gid_attrs/ndevs/10"), "z0\n");
    assert_eq!(read_devices(sys.root())[0].ports[0].netdevs, ["b0", "a0", "c0", "z0"]);
}

#[test]
fn a_missing_or_odd_tree_lists_nothing() {
    let sys = FakeSysfs::new();
    assert!(read_devices(sys.root()).is_empty());
    assert!(read_devices(&sys.root().join("absent")).is_empty());
    fs::remove_dir(sys.root().join("class/infiniband")).unwrap();
    write(&sys.root().join("class/infiniband"), "not a directory");
    assert!(read_devices(sys.root()).is_empty());
}

#[test]
fn symlink_loops_fail_cleanly() {
    let sys = FakeSysfs::new();
    symlink("loop", sys.class_entry("loop")).unwrap();
    symlink("ping", sys.class_entry("pong")).unwrap();
    symlink("pong", sys.class_entry("ping")).unwrap();
    let dev = sys.virtual_device("rxe0");
    symlink("device", dev.join("device")).unwrap();
    let port = sys.port(&dev, 1, &PortSpec::roce("4: ACTIVE", HDR, "veth0"));
    fs::remove_file(port.join("rate")).unwrap();
    symlink("rate", port.join("rate")).unwrap();
    symlink("7", port.join("gid_attrs/ndevs/7")).unwrap();
    let devices = read_devices(sys.root());
    assert_eq!(devices.len(), 1);
    let d = &devices[0];
    assert_eq!((d.name.as_str(), d.numa_node, d.pci_address.as_deref()), ("rxe0", None, None));
    assert_eq!(d.ports[0].rate_mbps, None);
    assert_eq!(d.ports[0].netdevs, ["veth0"]);
    assert_eq!(d.ports[0].state, "ACTIVE");
}

#[test]
fn huge_files_and_bad_utf8_are_absent_facts() {
    let sys = FakeSysfs::new();
    let dev = sys.pci_device("mlx5_0", "0000:3b:00.0", 0);
    let port = sys.port(&dev, 1, &PortSpec::roce("4: ACTIVE", HDR, "eth0"));
    write(&port.join("rate"), "1".repeat(1 << 20) + " Gb/sec");
    write(&port.join("state"), b"4: ACT\xffIVE\n");
    write(&port.join("link_layer"), "Ether\0net\n");
    write(&port.join("gid_attrs/ndevs/1"), b"eth\xfe1\n");
    write(&port.join("gid_attrs/ndevs/2"), "x".repeat(4097));
    write(&port.join("gid_attrs/ndevs/3"), "eth1\n");
    write(&dev.join("device/numa_node"), "0".repeat(5000));
    let d = &read_devices(sys.root())[0];
    assert_eq!(d.numa_node, None);
    assert_eq!(d.pci_address.as_deref(), Some("0000:3b:00.0"));
    let p = &d.ports[0];
    assert_eq!((p.state.as_str(), p.link_layer.as_str(), p.rate_mbps), ("", "", None));
    assert_eq!(p.netdevs, ["eth0", "eth1"]);
}

#[test]
fn names_with_dots_slashes_or_junk_are_skipped() {
    let sys = FakeSysfs::new();
    for bad in ["..dev", "a..b", "has space", "tab\tname"] {
        fs::create_dir_all(sys.class_entry(bad)).unwrap();
    }
    fs::create_dir_all(sys.class_entry(&"d".repeat(65))).unwrap();
    let dev = sys.virtual_device("rxe0");
    let ndevs = vec![Some("../../etc/passwd"), Some("a/b"), Some(".."), Some("veth0"), Some("two words")];
    let port = sys.port(&dev, 1, &PortSpec { state: "4: ../..", link_layer: "../Ethernet", rate: "10 Gb/sec", ndevs });
    for odd in ["0", "256", "01x", "-1", "..", "port"] {
        fs::create_dir_all(dev.join("ports").join(odd).join("gid_attrs")).unwrap();
    }
    write(&port.join("gid_attrs/ndevs/..x"), "veth9\n");
    let devices = read_devices(sys.root());
    assert_eq!(devices.len(), 1);
    let d = &devices[0];
    assert_eq!(d.name, "rxe0");
    assert_eq!(d.ports.len(), 1, "only port 1 is a port number");
    let p = &d.ports[0];
    assert_eq!((p.state.as_str(), p.link_layer.as_str()), ("", ""));
    assert_eq!(p.netdevs, ["veth0"]);
}

#[test]
fn links_leading_out_of_the_root_are_not_followed() {
    let sys = FakeSysfs::new();
    let outside = tempfile::tempdir().unwrap();
    // A device whose whole directory lives elsewhere is not part of this tree.
    let foreign = outside.path().join("mlx5_9");
    write(&foreign.join("ports/1/state"), "4: ACTIVE\n");
    symlink(&foreign, sys.class_entry("mlx5_9")).unwrap();
    // A device whose parent and attribute files point elsewhere keeps only what is inside.
    let parent = outside.path().join("0000:99:00.0");
    write(&parent.join("numa_node"), "1\n");
    write(&outside.path().join("rate"), "400 Gb/sec (4X NDR)\n");
    let dev = sys.virtual_device("mlx5_0");
    symlink(&parent, dev.join("device")).unwrap();
    let port = sys.port(&dev, 1, &PortSpec::roce("4: ACTIVE", HDR, "eth0"));
    fs::remove_file(port.join("rate")).unwrap();
    symlink(outside.path().join("rate"), port.join("rate")).unwrap();
    symlink("../../../../../../../../../../../../etc/hostname", port.join("gid_attrs/ndevs/9")).unwrap();
    let devices = read_devices(sys.root());
    assert_eq!(devices.len(), 1);
    let d = &devices[0];
    assert_eq!((d.name.as_str(), d.numa_node, d.pci_address.as_deref()), ("mlx5_0", None, None));
    assert_eq!(d.ports[0].rate_mbps, None);
    assert_eq!(d.ports[0].netdevs, ["eth0"]);
}

/// One device read alone is what the whole tree's listing says of it; names that are not a
/// device's, or whose directory lies outside the root, read as nothing.
#[test]
fn one_device_alone_reads_as_in_the_whole_tree() {
    let sys = FakeSysfs::new();
    for i in 0..3 {
        let dev = sys.pci_device(&format!("mlx5_{i}"), &format!("0000:{:02x}:00.0", i + 1), i % 2);
        sys.port(&dev, 1, &PortSpec::roce("4: ACTIVE", HDR, &format!("ens{i}np0")));
    }
    let outside = tempfile::tempdir().unwrap();
    write(&outside.path().join("mlx5_9/ports/1/state"), "4: ACTIVE\n");
    symlink(outside.path().join("mlx5_9"), sys.class_entry("mlx5_9")).unwrap();
    let all = read_devices(sys.root());
    assert_eq!(all.len(), 3);
    for d in &all {
        assert_eq!(read_device(sys.root(), &d.name).as_ref(), Some(d));
    }
    for name in ["mlx5_7", "mlx5_9", "", ".", "..", "mlx5_0/../mlx5_1", "../infiniband/mlx5_0", "mlx5_0/ports"] {
        assert_eq!(read_device(sys.root(), name), None, "{name:?}");
    }
    assert_eq!(read_device(&outside.path().join("no-such-root"), "mlx5_0"), None);
}

#[test]
fn fifos_and_directories_are_never_read() {
    let sys = FakeSysfs::new();
    let dev = sys.virtual_device("rxe0");
    let port = sys.port(&dev, 1, &PortSpec::roce("4: ACTIVE", HDR, "veth0"));
    fs::remove_file(port.join("state")).unwrap();
    // Opening a FIFO for reading blocks until a writer comes: it must not be opened at all.
    nix::unistd::mkfifo(&port.join("state"), nix::sys::stat::Mode::S_IRWXU).unwrap();
    fs::remove_file(port.join("link_layer")).unwrap();
    fs::create_dir(port.join("link_layer")).unwrap();
    let p = &read_devices(sys.root())[0].ports[0];
    assert_eq!((p.state.as_str(), p.link_layer.as_str(), p.rate_mbps), ("", "", Some(200_000)));
}

/// The placement policy over what a real two-socket, eight-NIC server's sysfs says: the devices'
/// NUMA nodes and speeds come from the tree, a down port makes its path unusable, and a region's
/// node picks the socket.
#[test]
fn placement_over_a_two_socket_eight_nic_tree() {
    use xfer_engine::placement::{place, DeviceFacts, PathView};
    let sys = FakeSysfs::new();
    for i in 0..8u32 {
        let dev = sys.pci_device(&format!("mlx5_{i}"), &format!("0000:{:02x}:00.0", 0x10 + i), if i < 4 { 0 } else { 1 });
        let state = if i == 6 { "1: DOWN" } else { "4: ACTIVE" };
        sys.port(&dev, 1, &PortSpec::roce(state, HDR, &format!("ens{i}np0")));
    }
    let topo = read_devices(sys.root());
    let facts: Vec<DeviceFacts> = topo
        .iter()
        .map(|d| DeviceFacts { name: d.name.clone(), numa: d.numa_node, speed_mbps: d.ports.first().and_then(|p| p.rate_mbps) })
        .collect();
    let paths: Vec<PathView> = topo
        .iter()
        .enumerate()
        .map(|(i, d)| PathView { device: i, usable: d.ports.iter().any(|p| p.state == "ACTIVE"), rate: None, in_flight: 0 })
        .collect();
    // A 64 MiB job from socket 1's memory stays on socket 1's three live NICs.
    let w = place(Some(1), &facts, &paths, 64 << 20);
    assert_eq!(w, vec![0, 0, 0, 0, 1000, 1000, 0, 1000]);
    // From socket 0: its four NICs.
    assert_eq!(place(Some(0), &facts, &paths, 64 << 20), vec![1000, 1000, 1000, 1000, 0, 0, 0, 0]);
    // 8 GiB from socket 1 would take 3 NICs' time alone: it spills to socket 0, whose NICs weigh
    // 1/1.5 of a local one; the down NIC carries nothing.
    let w = place(Some(1), &facts, &paths, 8 << 30);
    assert_eq!(w, vec![667, 667, 667, 667, 1000, 1000, 0, 1000]);
}
