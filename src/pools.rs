//! What is made ahead of the creates that take it — network namespaces,
//! pool slots, run directories — is topped up in the background, on one
//! policy.

use std::time::Duration;

/// How long a top-up waits while a spare is left. A run's first exec
/// usually follows its create at once, and making the next spare (a
/// network namespace is ~0.6 ms of CPU, most of it in `unshare`; a run
/// directory's ext4 `mkdir` ~0.2 ms) competed with it and with the
/// create's reply on a small host. An empty pool is topped up at once.
pub const TOP_UP_DELAY: Duration = Duration::from_millis(50);

/// Runs `top_up` at once when no spare is left, else after
/// [`TOP_UP_DELAY`]. Needs a tokio runtime.
pub fn top_up_soon(spare_left: bool, top_up: impl FnOnce() + Send + 'static) {
    if !spare_left {
        return top_up();
    }
    tokio::spawn(async move {
        tokio::time::sleep(TOP_UP_DELAY).await;
        top_up();
    });
}
