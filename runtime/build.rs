//! Builds the run init (`init/init.c`) as a static executable; the runtime
//! embeds it so the sbx binary carries everything a run needs.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    println!("cargo:rerun-if-changed=init/init.c");
    let status = Command::new(&cc)
        .args(["-static", "-Os", "-s", "-Wall", "-Werror", "-o"])
        .arg(out.join("sbx-init"))
        .arg("init/init.c")
        .status()
        .expect("run the C compiler for init/init.c");
    assert!(
        status.success(),
        "building the static run init failed ({cc})"
    );
}
