//! Host-level names a daemon creates, derived from its key (a hash of its
//! state dir) and the run id, so two daemons never collide and everything
//! of a daemon can be found again after a crash. Pure.

/// The network tiers that have links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Allowlist,
    Open,
}

/// FNV-1a, 64 bit: a stable short hash for interface names.
pub fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// 8 hex characters.
    pub key: String,
}

impl Names {
    pub fn new(key: &str) -> Names {
        Names {
            key: key
                .chars()
                .filter(char::is_ascii_hexdigit)
                .take(8)
                .collect(),
        }
    }

    pub fn bridge(&self, tier: Tier) -> String {
        match tier {
            Tier::Allowlist => format!("sbxa{}", self.key),
            Tier::Open => format!("sbxo{}", self.key),
        }
    }

    fn run_hex(&self, run_id: &str) -> String {
        format!(
            "{:010x}",
            fnv(&format!("{}/{run_id}", self.key)) & 0xff_ffff_ffff
        )
    }

    /// The host end of a slot's veth (≤ 15 characters). A slot is a
    /// prepared network namespace, named by 10 hex characters.
    pub fn veth(&self, slot: &str) -> String {
        format!("vsbx{slot}")
    }

    /// The slot end's name until it is renamed eth0 inside its namespace.
    pub fn peer(&self, slot: &str) -> String {
        format!("psbx{slot}")
    }

    /// A fresh slot name for `seed` (anything unique: a counter, a time).
    pub fn slot(&self, seed: &str) -> String {
        self.run_hex(seed)
    }

    /// The daemon's inet table (input, forward, NAT).
    pub fn table(&self) -> String {
        format!("sbx-{}", self.key)
    }

    /// A slot's bridge-family table (anti-spoofing on its port).
    pub fn run_table(&self, slot: &str) -> String {
        format!("sbxr-{}-{slot}", self.key)
    }

    pub fn run_table_prefix(&self) -> String {
        format!("sbxr-{}-", self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_ifnamsiz_and_differ_per_daemon_and_slot() {
        let a = Names::new("1a2b3c4d");
        let b = Names::new("deadbeef");
        let slot = a.slot("01JZ0000000000000000000000");
        assert_eq!(slot.len(), 10);
        for n in [
            a.bridge(Tier::Allowlist),
            a.bridge(Tier::Open),
            a.veth(&slot),
            a.peer(&slot),
        ] {
            assert!(n.len() <= 15, "{n}");
        }
        assert_ne!(a.slot("x"), b.slot("x"));
        assert_ne!(a.slot("x"), a.slot("y"));
        assert!(a.run_table(&slot).starts_with(&a.run_table_prefix()));
        assert!(!b.run_table(&slot).starts_with(&a.run_table_prefix()));
        assert_eq!(a.bridge(Tier::Allowlist), "sbxa1a2b3c4d");
    }
}
