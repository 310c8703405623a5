//! nftables over netlink (libnftnl): the daemon's inet table and one bridge
//! table per run. No `nft` or `iptables` command is run.
//!
//! Daemon table `inet sbx-<key>`:
//! - input: from the allowlist bridge only TCP to the gateway's proxy port
//!   range; nothing else from either bridge reaches this host.
//! - forward: nothing from or to the allowlist bridge; nothing between open
//!   runs; into the open bridge only replies.
//! - postrouting (nat): open runs are masqueraded on the way out.
//!
//! Run table `bridge sbxr-<key>-<run>`: on the run's port only its own IPv4
//! source address (IP and ARP) passes; IPv6 and every other protocol drop.

use std::ffi::CString;
use std::net::Ipv4Addr;

use nftnl::expr::{InterfaceName, States};
use nftnl::{
    nft_expr, Batch, Chain, ChainType, FinalizedBatch, Hook, MsgType, Policy, ProtoFamily, Rule,
    Table,
};

use crate::ipam::Subnet;

#[derive(Debug, thiserror::Error)]
pub enum FirewallError {
    #[error("bad name {0:?}")]
    Name(String),
    #[error("nftables {op}")]
    Netlink {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

fn cname(s: &str) -> Result<CString, FirewallError> {
    CString::new(s).map_err(|_| FirewallError::Name(s.to_string()))
}

fn send(batch: &FinalizedBatch, op: &'static str) -> Result<(), FirewallError> {
    let err = |source| FirewallError::Netlink { op, source };
    let socket = mnl::Socket::new(mnl::Bus::Netfilter).map_err(err)?;
    let portid = socket.portid();
    socket.send_all(batch).map_err(err)?;
    let mut storage = vec![0u8; nftnl::nft_nlmsg_maxsize() as usize + 8];
    let buffer = aligned(&mut storage);
    let mut expected = batch.sequence_numbers();
    while !expected.is_empty() {
        for message in socket.recv(buffer).map_err(err)? {
            let message = message.map_err(err)?;
            let Some(seq) = expected.next() else { break };
            mnl::cb_run(message, seq, portid).map_err(err)?;
        }
    }
    Ok(())
}

/// The part of `storage` aligned for netlink headers (mnl requires it).
fn aligned(storage: &mut [u8]) -> &mut [u8] {
    let off = storage.as_ptr().align_offset(std::mem::align_of::<u32>());
    &mut storage[off..]
}

fn iif(rule: &mut Rule, name: &CString) {
    rule.add_expr(&nft_expr!(meta iifname));
    rule.add_expr(&nft_expr!(cmp == InterfaceName::Exact(name.clone())));
}

fn oif(rule: &mut Rule, name: &CString) {
    rule.add_expr(&nft_expr!(meta oifname));
    rule.add_expr(&nft_expr!(cmp == InterfaceName::Exact(name.clone())));
}

/// What the daemon table needs to know.
#[derive(Debug, Clone)]
pub struct DaemonRules {
    pub table: String,
    pub allow_bridge: String,
    pub allow_gateway: Ipv4Addr,
    pub open_bridge: String,
    pub open_subnet: Subnet,
    /// Inclusive range of proxy ports on the allowlist gateway.
    pub proxy_ports: (u16, u16),
}

/// Queues `table` emptied and re-created (add, delete, add: the delete
/// succeeds whether or not it existed), so a batch replaces it atomically.
fn fresh_table(batch: &mut Batch, table: &Table) {
    batch.add(table, MsgType::Add);
    batch.add(table, MsgType::Del);
    batch.add(table, MsgType::Add);
}

/// Queues a base chain with policy accept.
fn base_chain<'a>(
    batch: &mut Batch,
    table: &'a Table,
    name: &'static std::ffi::CStr,
    hook: Hook,
    prio: i32,
    nat: bool,
) -> Chain<'a> {
    let mut chain = Chain::new(name, table);
    chain.set_hook(hook, prio);
    if nat {
        chain.set_type(ChainType::Nat);
    }
    chain.set_policy(Policy::Accept);
    batch.add(&chain, MsgType::Add);
    chain
}

/// Queues one rule of `chain`, made by `build`.
fn rule(batch: &mut Batch, chain: &Chain, build: impl FnOnce(&mut Rule)) {
    let mut r = Rule::new(chain);
    build(&mut r);
    batch.add(&r, MsgType::Add);
}

fn drop_verdict(r: &mut Rule) {
    r.add_expr(&nft_expr!(verdict drop));
}

/// Replaces the daemon table atomically.
pub fn apply_daemon(r: &DaemonRules) -> Result<(), FirewallError> {
    let table = Table::new(&cname(&r.table)?, ProtoFamily::Inet);
    let (a, o) = (cname(&r.allow_bridge)?, cname(&r.open_bridge)?);
    let mut batch = Batch::new();
    fresh_table(&mut batch, &table);

    let input = base_chain(&mut batch, &table, c"input", Hook::In, 0, false);
    rule(&mut batch, &input, |rule| {
        iif(rule, &a);
        rule.add_expr(&nft_expr!(meta nfproto));
        rule.add_expr(&nft_expr!(cmp == libc::NFPROTO_IPV4 as u8));
        rule.add_expr(&nft_expr!(payload ipv4 daddr));
        rule.add_expr(&nft_expr!(cmp == r.allow_gateway));
        rule.add_expr(&nft_expr!(meta l4proto));
        rule.add_expr(&nft_expr!(cmp == libc::IPPROTO_TCP as u8));
        rule.add_expr(&nft_expr!(payload tcp dport));
        rule.add_expr(&nft_expr!(cmp >= r.proxy_ports.0.to_be()));
        rule.add_expr(&nft_expr!(payload tcp dport));
        rule.add_expr(&nft_expr!(cmp <= r.proxy_ports.1.to_be()));
        rule.add_expr(&nft_expr!(verdict accept));
    });
    for bridge in [&a, &o] {
        rule(&mut batch, &input, |rule| {
            iif(rule, bridge);
            drop_verdict(rule);
        });
    }

    let forward = base_chain(&mut batch, &table, c"forward", Hook::Forward, 0, false);
    rule(&mut batch, &forward, |rule| {
        iif(rule, &a);
        drop_verdict(rule);
    });
    rule(&mut batch, &forward, |rule| {
        oif(rule, &a);
        drop_verdict(rule);
    });
    rule(&mut batch, &forward, |rule| {
        iif(rule, &o);
        oif(rule, &o);
        drop_verdict(rule);
    });
    rule(&mut batch, &forward, |rule| {
        oif(rule, &o);
        rule.add_expr(&nft_expr!(ct state));
        rule.add_expr(
            &nft_expr!(bitwise mask (States::ESTABLISHED | States::RELATED).bits(), xor 0u32),
        );
        rule.add_expr(&nft_expr!(cmp != 0u32));
        rule.add_expr(&nft_expr!(verdict accept));
    });
    rule(&mut batch, &forward, |rule| {
        oif(rule, &o);
        drop_verdict(rule);
    });
    // IPv6 from the open bridge goes nowhere (runs have it disabled anyway).
    rule(&mut batch, &forward, |rule| {
        iif(rule, &o);
        rule.add_expr(&nft_expr!(meta nfproto));
        rule.add_expr(&nft_expr!(cmp != libc::NFPROTO_IPV4 as u8));
        drop_verdict(rule);
    });

    let post = base_chain(
        &mut batch,
        &table,
        c"postrouting",
        Hook::PostRouting,
        100,
        true,
    );
    let mask = u32::MAX
        .checked_shl(32 - u32::from(r.open_subnet.prefix))
        .unwrap_or(0);
    rule(&mut batch, &post, |rule| {
        rule.add_expr(&nft_expr!(meta nfproto));
        rule.add_expr(&nft_expr!(cmp == libc::NFPROTO_IPV4 as u8));
        rule.add_expr(&nft_expr!(payload ipv4 saddr));
        rule.add_expr(&nft_expr!(bitwise mask Ipv4Addr::from(mask), xor 0u32));
        rule.add_expr(&nft_expr!(cmp == r.open_subnet.network));
        rule.add_expr(&nft_expr!(meta oifname));
        rule.add_expr(&nft_expr!(cmp != InterfaceName::Exact(o.clone())));
        rule.add_expr(&nft_expr!(masquerade));
    });

    send(&batch.finalize(), "apply the daemon table")
}

/// Installs a run's anti-spoofing table for its port `veth` and address `ip`.
pub fn apply_run(table_name: &str, veth: &str, ip: Ipv4Addr) -> Result<(), FirewallError> {
    let table = Table::new(&cname(table_name)?, ProtoFamily::Bridge);
    let v = cname(veth)?;
    let mut batch = Batch::new();
    fresh_table(&mut batch, &table);
    let pre = base_chain(
        &mut batch,
        &table,
        c"prerouting",
        Hook::PreRouting,
        -200,
        false,
    );
    let eth_ip = (libc::ETH_P_IP as u16).to_be();
    let eth_arp = (libc::ETH_P_ARP as u16).to_be();
    // IPv4 with another source address.
    rule(&mut batch, &pre, |rule| {
        iif(rule, &v);
        rule.add_expr(&nft_expr!(meta proto));
        rule.add_expr(&nft_expr!(cmp == eth_ip));
        rule.add_expr(&nft_expr!(payload ipv4 saddr));
        rule.add_expr(&nft_expr!(cmp != ip));
        drop_verdict(rule);
    });
    // ARP claiming another sender address (offset 14 bytes in the ARP header).
    rule(&mut batch, &pre, |rule| {
        iif(rule, &v);
        rule.add_expr(&nft_expr!(meta proto));
        rule.add_expr(&nft_expr!(cmp == eth_arp));
        rule.add_expr(&nft_expr!(payload_raw nh 14, 4));
        rule.add_expr(&nft_expr!(cmp != ip));
        drop_verdict(rule);
    });
    // Everything that is neither IPv4 nor ARP (IPv6, router adverts, …).
    rule(&mut batch, &pre, |rule| {
        iif(rule, &v);
        rule.add_expr(&nft_expr!(meta proto));
        rule.add_expr(&nft_expr!(cmp != eth_ip));
        rule.add_expr(&nft_expr!(meta proto));
        rule.add_expr(&nft_expr!(cmp != eth_arp));
        drop_verdict(rule);
    });
    send(&batch.finalize(), "apply a run table")
}

/// Deletes a table if it exists.
pub fn delete_table(name: &str, family: ProtoFamily) -> Result<(), FirewallError> {
    let table = Table::new(&cname(name)?, family);
    let mut batch = Batch::new();
    // Adding first makes the delete succeed whether or not it existed.
    batch.add(&table, MsgType::Add);
    batch.add(&table, MsgType::Del);
    send(&batch.finalize(), "delete a table")
}

/// Deletes a run's bridge table if it exists.
pub fn delete_run_table(name: &str) -> Result<(), FirewallError> {
    delete_table(name, ProtoFamily::Bridge)
}

/// Deletes the daemon's inet table if it exists.
pub fn delete_daemon_table(name: &str) -> Result<(), FirewallError> {
    delete_table(name, ProtoFamily::Inet)
}

/// Names of every nftables table (all families).
pub fn table_names() -> Result<Vec<String>, FirewallError> {
    let err = |source| FirewallError::Netlink {
        op: "list tables",
        source,
    };
    let socket = mnl::Socket::new(mnl::Bus::Netfilter).map_err(err)?;
    let seq = 0;
    let portid = socket.portid();
    socket
        .send(&nftnl::table::get_tables_nlmsg(seq))
        .map_err(err)?;
    let mut tables = std::collections::HashSet::new();
    let mut storage = vec![0u8; nftnl::nft_nlmsg_maxsize() as usize + 8];
    let buffer = aligned(&mut storage);
    loop {
        let n = socket.recv(buffer).map_err(err)?;
        let mut done = false;
        for message in n {
            let message = message.map_err(err)?;
            match mnl::cb_run2(
                message,
                seq,
                portid,
                nftnl::table::get_tables_cb,
                &mut tables,
            )
            .map_err(err)?
            {
                mnl::CbResult::Stop => done = true,
                mnl::CbResult::Ok => {}
            }
        }
        if done {
            break;
        }
    }
    Ok(tables
        .into_iter()
        .map(|t| t.to_string_lossy().into_owned())
        .collect())
}
