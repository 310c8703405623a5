//! Writable leases with fencing tokens: a pure state machine. The registry
//! owns one [`LeaseState`] per run, persists it before answering, and maps
//! the outcomes to statuses.
//!
//! Time is a monotonic millisecond count (`CLOCK_BOOTTIME`, which keeps
//! counting across suspend and across daemon restarts, but not across
//! reboots — after which no run survives anyway). A wall-clock jump changes
//! nothing here: expiry never reads the wall clock; only the `expiresAt`
//! shown to clients is derived from it at render time. If the monotonic
//! source were ever to step backwards, the state machine clamps to the
//! latest time it has seen, so a lease can never become valid again.

use serde::{Deserialize, Serialize};

pub const MAX_LEASE_TTL_SECS: u64 = 24 * 60 * 60;

/// The active lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub holder: String,
    pub generation: u64,
    /// Monotonic ms at which it lapses.
    pub expires_mono_ms: u64,
}

/// One run's lease state. `generation` is the last one granted; it only grows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseState {
    pub generation: u64,
    pub current: Option<Lease>,
    /// Latest monotonic time seen (never goes backwards).
    pub seen_mono_ms: u64,
}

/// Why a lease operation or a fenced write was refused (all 409s).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("an exec or file write is in flight; try again between operations")]
    Busy,
    #[error("the lease is held by {holder} (generation {generation})")]
    Held {
        holder: String,
        generation: u64,
        expires_mono_ms: u64,
    },
    #[error("credential generation {given} is superseded (current generation {current})")]
    Superseded { given: u64, current: u64 },
}

impl LeaseState {
    fn tick(&mut self, now: u64) -> u64 {
        self.seen_mono_ms = self.seen_mono_ms.max(now);
        self.seen_mono_ms
    }

    /// The lease if it is still in force at `now` (lazy expiry: nothing
    /// sweeps; a lapsed lease just stops counting).
    pub fn active(&mut self, now: u64) -> Option<&Lease> {
        let now = self.tick(now);
        self.current.as_ref().filter(|l| l.expires_mono_ms > now)
    }

    fn held_error(l: &Lease) -> LeaseError {
        LeaseError::Held {
            holder: l.holder.clone(),
            generation: l.generation,
            expires_mono_ms: l.expires_mono_ms,
        }
    }

    /// Grants the lease to `owner` (fresh, after expiry, or re-acquire by
    /// the same owner); every grant bumps the generation.
    pub fn acquire(
        &mut self,
        owner: &str,
        ttl_ms: u64,
        now: u64,
        in_flight: u32,
    ) -> Result<Lease, LeaseError> {
        let now = self.tick(now);
        if in_flight > 0 {
            return Err(LeaseError::Busy);
        }
        if let Some(l) = self.active(now) {
            if l.holder != owner {
                return Err(Self::held_error(l));
            }
        }
        self.generation += 1;
        let lease = Lease {
            holder: owner.to_string(),
            generation: self.generation,
            expires_mono_ms: now + ttl_ms,
        };
        self.current = Some(lease.clone());
        Ok(lease)
    }

    /// Checks a presented credential against the lease in force.
    fn check_credential(
        &mut self,
        owner: &str,
        generation: u64,
        now: u64,
    ) -> Result<(), LeaseError> {
        let current = self.generation;
        match self.active(now) {
            Some(l) if l.holder == owner && l.generation == generation => Ok(()),
            Some(l) if generation >= l.generation => Err(Self::held_error(l)),
            // Older than the lease in force, lapsed, released, or never granted.
            _ => Err(LeaseError::Superseded {
                given: generation,
                current,
            }),
        }
    }

    pub fn renew(
        &mut self,
        owner: &str,
        generation: u64,
        ttl_ms: u64,
        now: u64,
    ) -> Result<Lease, LeaseError> {
        let now = self.tick(now);
        self.check_credential(owner, generation, now)?;
        let lease = self.current.as_mut().ok_or(LeaseError::Superseded {
            given: generation,
            current: self.generation,
        })?;
        lease.expires_mono_ms = now + ttl_ms;
        Ok(lease.clone())
    }

    pub fn release(&mut self, owner: &str, generation: u64, now: u64) -> Result<(), LeaseError> {
        self.check_credential(owner, generation, now)?;
        self.current = None;
        Ok(())
    }

    /// Fencing for exec and file writes. With no lease in force a write
    /// without a credential passes (the pre-lease path); a credential must
    /// always be the one in force.
    pub fn check_write(
        &mut self,
        credential: Option<(&str, u64)>,
        now: u64,
    ) -> Result<(), LeaseError> {
        match credential {
            Some((owner, generation)) => self.check_credential(owner, generation, now),
            None => match self.active(now) {
                Some(l) => Err(Self::held_error(l)),
                None => Ok(()),
            },
        }
    }
}

/// Milliseconds of `CLOCK_BOOTTIME`.
pub fn mono_now_ms() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s() -> LeaseState {
        LeaseState::default()
    }

    #[test]
    fn fresh_grant_starts_at_generation_one() {
        let mut st = s();
        let l = st.acquire("alice", 1000, 10, 0).expect("grant");
        assert_eq!(
            (l.holder.as_str(), l.generation, l.expires_mono_ms),
            ("alice", 1, 1010)
        );
    }

    #[test]
    fn every_grant_bumps_the_generation_including_reacquire() {
        let mut st = s();
        assert_eq!(st.acquire("a", 100, 0, 0).expect("1").generation, 1);
        assert_eq!(st.acquire("a", 100, 10, 0).expect("re").generation, 2);
        assert_eq!(
            st.acquire("b", 100, 200, 0)
                .expect("after expiry")
                .generation,
            3
        );
        st.release("b", 3, 210).expect("release");
        assert_eq!(
            st.acquire("c", 100, 220, 0)
                .expect("after release")
                .generation,
            4
        );
    }

    #[test]
    fn held_by_another_owner_is_refused_with_who_and_until_when() {
        let mut st = s();
        st.acquire("a", 100, 0, 0).expect("grant");
        assert_eq!(
            st.acquire("b", 100, 50, 0),
            Err(LeaseError::Held {
                holder: "a".into(),
                generation: 1,
                expires_mono_ms: 100
            })
        );
        assert_eq!(st.generation, 1, "a refused grant does not bump");
    }

    #[test]
    fn busy_while_an_operation_is_in_flight() {
        let mut st = s();
        assert_eq!(st.acquire("a", 100, 0, 1), Err(LeaseError::Busy));
        assert_eq!(st.generation, 0);
        st.acquire("a", 100, 0, 0).expect("grant");
        assert_eq!(
            st.acquire("a", 100, 1, 2),
            Err(LeaseError::Busy),
            "even for the holder"
        );
    }

    #[test]
    fn renew_extends_only_the_exact_credential() {
        let mut st = s();
        st.acquire("a", 100, 0, 0).expect("grant");
        assert_eq!(
            st.renew("a", 1, 500, 50).expect("renew").expires_mono_ms,
            550
        );
        assert_eq!(
            st.renew("a", 0, 500, 60),
            Err(LeaseError::Superseded {
                given: 0,
                current: 1
            })
        );
        assert!(matches!(
            st.renew("b", 1, 500, 60),
            Err(LeaseError::Held { .. })
        ));
    }

    #[test]
    fn a_lapsed_holder_cannot_renew_release_or_write() {
        let mut st = s();
        st.acquire("a", 100, 0, 0).expect("grant");
        // Lapsed, no one else took it yet: the old credential is still dead.
        assert_eq!(
            st.renew("a", 1, 100, 150),
            Err(LeaseError::Superseded {
                given: 1,
                current: 1
            })
        );
        assert_eq!(
            st.check_write(Some(("a", 1)), 150),
            Err(LeaseError::Superseded {
                given: 1,
                current: 1
            })
        );
        st.acquire("b", 100, 200, 0).expect("b");
        assert_eq!(
            st.release("a", 1, 210),
            Err(LeaseError::Superseded {
                given: 1,
                current: 2
            })
        );
        assert_eq!(
            st.check_write(Some(("a", 1)), 210),
            Err(LeaseError::Superseded {
                given: 1,
                current: 2
            })
        );
    }

    #[test]
    fn writes_pass_without_a_lease_and_are_fenced_with_one() {
        let mut st = s();
        assert_eq!(st.check_write(None, 0), Ok(()));
        st.acquire("a", 100, 0, 0).expect("grant");
        assert_eq!(st.check_write(Some(("a", 1)), 10), Ok(()));
        assert!(matches!(
            st.check_write(None, 10),
            Err(LeaseError::Held { .. })
        ));
        assert!(matches!(
            st.check_write(Some(("b", 1)), 10),
            Err(LeaseError::Held { .. })
        ));
        assert!(
            matches!(
                st.check_write(Some(("a", 7)), 10),
                Err(LeaseError::Held { .. })
            ),
            "a future generation is not in force"
        );
        // After expiry the pre-lease path is open again.
        assert_eq!(st.check_write(None, 100), Ok(()));
    }

    #[test]
    fn release_frees_the_run_but_keeps_the_generation() {
        let mut st = s();
        st.acquire("a", 100, 0, 0).expect("grant");
        st.release("a", 1, 10).expect("release");
        assert_eq!(st.check_write(None, 11), Ok(()));
        assert_eq!(
            st.release("a", 1, 12),
            Err(LeaseError::Superseded {
                given: 1,
                current: 1
            })
        );
        assert_eq!(st.generation, 1);
    }

    #[test]
    fn the_clock_moving_backwards_never_revives_a_lease() {
        let mut st = s();
        st.acquire("a", 100, 1000, 0).expect("grant");
        assert!(st.active(1200).is_none(), "lapsed at 1100");
        // The source steps back to before the expiry: still lapsed.
        assert!(st.active(1050).is_none());
        assert_eq!(
            st.renew("a", 1, 100, 1050),
            Err(LeaseError::Superseded {
                given: 1,
                current: 1
            })
        );
        // A new grant starts from the latest time seen.
        assert_eq!(
            st.acquire("b", 100, 900, 0).expect("b").expires_mono_ms,
            1300
        );
    }
}
