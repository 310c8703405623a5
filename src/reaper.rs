//! The reaper: a tick (at most 5 s) that has the registry expire runs whose
//! TTL passed, whether or not anyone calls the API. Start-up reconciliation
//! lives with the registry (`runs::Registry::reconcile`), its one owner.

use std::time::Duration;

use crate::runs::Runs;

pub fn spawn(runs: Runs, tick_secs: u64) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut t = tokio::time::interval(Duration::from_secs(tick_secs));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            t.tick().await;
            runs.tick().await;
        }
    })
}
