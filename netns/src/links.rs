//! Links and addresses over rtnetlink: the daemon's bridges, a veth per
//! networked run (host end on the bridge with port isolation, run end moved
//! into the run's network namespace and configured from inside it).

use std::net::{IpAddr, Ipv4Addr};

use futures_util::TryStreamExt;
use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage};
use rtnetlink::{Handle, LinkBridge, LinkBridgePort, LinkUnspec, LinkVeth, RouteMessageBuilder};

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("netlink connection")]
    Connect(#[source] std::io::Error),
    #[error("{op} {name}: {message}")]
    Netlink {
        op: &'static str,
        name: String,
        message: String,
    },
    #[error("link {0} not found")]
    Missing(String),
    #[error("enter a run's network namespace (pid {pid}, 0 = pinned)")]
    Enter {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("set {path}")]
    Sysctl {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

fn nl(op: &'static str, name: &str) -> impl FnOnce(rtnetlink::Error) -> LinkError {
    let name = name.to_string();
    move |e| LinkError::Netlink {
        op,
        name,
        message: e.to_string(),
    }
}

fn is_exists(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -libc::EEXIST)
}

fn is_missing(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -libc::ENODEV || m.raw_code() == -libc::ENOENT)
}

/// Writes a sysctl of the calling thread's network namespace; a missing
/// file (no IPv6 in the kernel) is not an error.
pub fn sysctl(path: &str, value: &str) -> Result<(), LinkError> {
    match std::fs::write(path, value) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(LinkError::Sysctl {
            path: path.to_string(),
            source,
        }),
    }
}

/// A fixed, locally administered unicast address for bridge `name`.
pub fn bridge_mac(name: &str) -> [u8; 6] {
    // FNV-1a: stable across releases, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let b = h.to_be_bytes();
    [0x02, b[0], b[1], b[2], b[3], b[4]]
}

/// A netlink handle in the daemon's network namespace.
#[derive(Clone)]
pub struct Links {
    handle: Handle,
}

fn link_name(m: &LinkMessage) -> Option<String> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    })
}

impl Links {
    /// Opens a connection served by the current tokio runtime; for a few
    /// requests at a time. (A released run's veth goes this way: through a
    /// connection of its own thread its delete took 14-23 ms instead of
    /// ~1 ms here, not understood yet.)
    pub fn connect() -> Result<Links, LinkError> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(LinkError::Connect)?;
        tokio::spawn(conn);
        Ok(Links { handle })
    }

    /// Opens a connection served by a thread of its own for as long as a
    /// clone of the returned handle lives: for the daemon's long-lived one,
    /// which builds the network pool's slots.
    ///
    /// The kernel carries out a netlink request inside the sender's
    /// `sendmsg`, and some wait there for an RCU barrier under the rtnl
    /// lock (moving a veth into a namespace, deleting one): 10-30 ms seen
    /// here. On a runtime worker that stalled whatever was queued behind
    /// it: a networked run's first exec took 15-35 ms instead of ~2 ms
    /// while the pool built the next slot.
    pub fn connect_dedicated() -> Result<Links, LinkError> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("sbx-netlink".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .build();
                let rt = match rt {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    match rtnetlink::new_connection() {
                        Ok((conn, handle, _)) => {
                            let _ = tx.send(Ok(handle));
                            // Ends when the last handle is dropped.
                            conn.await;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                });
            })
            .map_err(LinkError::Connect)?;
        let handle = rx
            .recv()
            .map_err(|_| LinkError::Connect(std::io::Error::other("netlink thread ended")))?
            .map_err(LinkError::Connect)?;
        Ok(Links { handle })
    }

    pub async fn index(&self, name: &str) -> Result<Option<u32>, LinkError> {
        let mut links = self
            .handle
            .link()
            .get()
            .match_name(name.to_string())
            .execute();
        match links.try_next().await {
            Ok(Some(m)) => Ok(Some(m.header.index)),
            Ok(None) => Ok(None),
            Err(e) if is_missing(&e) => Ok(None),
            Err(e) => Err(nl("look up", name)(e)),
        }
    }

    /// The hardware address of link `index`.
    async fn mac(&self, index: u32) -> Result<Option<Vec<u8>>, LinkError> {
        let mut links = self.handle.link().get().match_index(index).execute();
        let m = links
            .try_next()
            .await
            .map_err(nl("look up", &index.to_string()))?;
        Ok(m.and_then(|m| {
            m.attributes.into_iter().find_map(|a| match a {
                LinkAttribute::Address(mac) if mac.len() == 6 => Some(mac),
                _ => None,
            })
        }))
    }

    /// Names of the links enslaved to bridge `bridge`.
    pub async fn ports_of(&self, bridge: u32) -> Result<Vec<String>, LinkError> {
        let mut out = Vec::new();
        let mut links = self.handle.link().get().execute();
        while let Some(m) = links.try_next().await.map_err(nl("list links", "ports"))? {
            let on_bridge = m
                .attributes
                .iter()
                .any(|a| matches!(a, LinkAttribute::Controller(i) if *i == bridge));
            if on_bridge {
                if let Some(n) = link_name(&m) {
                    out.push(n);
                }
            }
        }
        Ok(out)
    }

    /// Creates the bridge if needed, with `gateway/prefix`, IPv6 off, up.
    pub async fn ensure_bridge(
        &self,
        name: &str,
        gateway: Ipv4Addr,
        prefix: u8,
    ) -> Result<u32, LinkError> {
        if self.index(name).await?.is_none() {
            match self
                .handle
                .link()
                .add(
                    LinkBridge::new(name)
                        .address(bridge_mac(name).to_vec())
                        .build(),
                )
                .execute()
                .await
            {
                Ok(()) => {}
                Err(e) if is_exists(&e) => {}
                Err(e) => return Err(nl("create bridge", name)(e)),
            }
        }
        let index = self
            .index(name)
            .await?
            .ok_or_else(|| LinkError::Missing(name.to_string()))?;
        sysctl(&format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1")?;
        // A bridge whose address was never set takes the lowest address of
        // its ports and changes it whenever ports come and go; every run's
        // cached gateway address then points nowhere and its traffic to the
        // gateway (the egress proxy) is dropped until the neighbour entry
        // ages out (seen: 60 s of SYN_SENT after an orphan veth was removed).
        // Setting it, even to the address it has, pins it.
        let mac = self
            .mac(index)
            .await?
            .unwrap_or_else(|| bridge_mac(name).to_vec());
        self.handle
            .link()
            .set(LinkUnspec::new_with_index(index).address(mac).build())
            .execute()
            .await
            .map_err(nl("pin the address of", name))?;
        match self
            .handle
            .address()
            .add(index, IpAddr::V4(gateway), prefix)
            .execute()
            .await
        {
            Ok(()) => {}
            Err(e) if is_exists(&e) => {}
            Err(e) => return Err(nl("address bridge", name)(e)),
        }
        self.handle
            .link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await
            .map_err(nl("bring up", name))?;
        Ok(index)
    }

    /// Deletes a link; a missing one is fine.
    pub async fn delete(&self, name: &str) -> Result<(), LinkError> {
        let Some(index) = self.index(name).await? else {
            return Ok(());
        };
        match self.handle.link().del(index).execute().await {
            Ok(()) => Ok(()),
            Err(e) if is_missing(&e) => Ok(()),
            Err(e) => Err(nl("delete", name)(e)),
        }
    }

    /// A veth pair: `host` on `bridge` (isolated port, up, no IPv6), `peer`
    /// moved into the pinned network namespace at `netns`.
    pub async fn attach(
        &self,
        bridge: u32,
        host: &str,
        peer: &str,
        netns: &std::path::Path,
    ) -> Result<(), LinkError> {
        let ns =
            std::fs::File::open(netns).map_err(|source| LinkError::Enter { pid: 0, source })?;
        self.handle
            .link()
            .add(LinkVeth::new(host, peer).build())
            .execute()
            .await
            .map_err(nl("create veth", host))?;
        let result = async {
            let index = self
                .index(host)
                .await?
                .ok_or_else(|| LinkError::Missing(host.to_string()))?;
            sysctl(&format!("/proc/sys/net/ipv6/conf/{host}/disable_ipv6"), "1")?;
            self.handle
                .link()
                .set(
                    LinkUnspec::new_with_index(index)
                        .controller(bridge)
                        .up()
                        .build(),
                )
                .execute()
                .await
                .map_err(nl("attach to bridge", host))?;
            // Port isolation must go through set_port: set() accepts the
            // attribute and silently ignores it.
            self.handle
                .link()
                .set_port(LinkBridgePort::new(index).isolated(true).build())
                .execute()
                .await
                .map_err(nl("isolate port", host))?;
            self.handle
                .link()
                .set(
                    LinkUnspec::new_with_name(peer)
                        .setns_by_fd(std::os::fd::AsRawFd::as_raw_fd(&ns))
                        .build(),
                )
                .execute()
                .await
                .map_err(nl("move into the run", peer))?;
            Ok(())
        }
        .await;
        if result.is_err() {
            let _ = self.delete(host).await;
        }
        result
    }
}

/// Configures the slot's end from inside the pinned namespace at `netns`:
/// renamed `eth0`, address, up, and a default route when `gateway` is
/// given. (IPv6, router advertisements and ping were set when the namespace
/// was made.) Blocking: it runs on its own thread, the only one whose
/// namespace changes.
pub fn configure_inside(
    netns: &std::path::Path,
    peer: &str,
    ip: Ipv4Addr,
    prefix: u8,
    gateway: Option<Ipv4Addr>,
) -> Result<(), LinkError> {
    let peer = peer.to_string();
    let netns = netns.to_path_buf();
    let worker = std::thread::spawn(move || -> Result<(), LinkError> {
        let ns =
            std::fs::File::open(&netns).map_err(|source| LinkError::Enter { pid: 0, source })?;
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
            LinkError::Enter {
                pid: 0,
                source: e.into(),
            }
        })?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(LinkError::Connect)?;
        rt.block_on(async {
            let links = Links::connect()?;
            let index = links
                .index(&peer)
                .await?
                .ok_or_else(|| LinkError::Missing(peer.clone()))?;
            links
                .handle
                .link()
                .set(
                    LinkUnspec::new_with_index(index)
                        .name("eth0".to_string())
                        .build(),
                )
                .execute()
                .await
                .map_err(nl("rename", &peer))?;
            links
                .handle
                .address()
                .add(index, IpAddr::V4(ip), prefix)
                .execute()
                .await
                .map_err(nl("address", "eth0"))?;
            links
                .handle
                .link()
                .set(LinkUnspec::new_with_index(index).up().build())
                .execute()
                .await
                .map_err(nl("bring up", "eth0"))?;
            if let Some(gw) = gateway {
                let route = RouteMessageBuilder::<Ipv4Addr>::new()
                    .gateway(gw)
                    .output_interface(index)
                    .build();
                links
                    .handle
                    .route()
                    .add(route)
                    .execute()
                    .await
                    .map_err(nl("default route", "eth0"))?;
            }
            Ok(())
        })
    });
    worker
        .join()
        .unwrap_or_else(|_| Err(LinkError::Missing("configuration thread panicked".into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bridge_mac_is_stable_local_and_unicast() {
        let a = bridge_mac("sbxa1234abcd");
        assert_eq!(a, bridge_mac("sbxa1234abcd"));
        assert_ne!(a, bridge_mac("sbxo1234abcd"));
        assert_eq!(a[0] & 0x01, 0, "unicast");
        assert_eq!(a[0] & 0x02, 0x02, "locally administered");
    }
}
