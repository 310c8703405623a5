//! End-to-end: the CLI client against a real daemon.

mod common;

use std::process::Command;

use common::{bin, require_root, Daemon};

fn sbx(d: &Daemon, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(args)
        .env("SBX_URL", d.url(""))
        .env("SBX_TOKEN_FILE", d.state.join("token"))
        .env_remove("SBX_TOKEN")
        .output()
        .expect("run sbx")
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn cli_runs_execs_copies_lists_and_removes() {
    if !require_root("cli_runs_execs_copies_lists_and_removes") {
        return;
    }
    let d = Daemon::start(&[]);
    let o = sbx(&d, &["run", "--label", "who=cli", "--ttl", "600"]);
    assert!(o.status.success(), "{o:?}");
    let id = stdout(&o).trim().to_string();
    assert_eq!(id.len(), 26, "{id}");
    // exec streams output and exits with the command's code.
    let o = sbx(
        &d,
        &[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 3",
        ],
    );
    assert_eq!(o.status.code(), Some(3));
    assert_eq!(stdout(&o), "out\n");
    assert_eq!(String::from_utf8_lossy(&o.stderr), "err\n");
    let o = sbx(
        &d,
        &[
            "exec",
            "-e",
            "GREETING=hi",
            &id,
            "--",
            "sh",
            "-c",
            "echo $GREETING",
        ],
    );
    assert_eq!((o.status.code(), stdout(&o)), (Some(0), "hi\n".to_string()));
    // cp both ways.
    let tmp = tempfile::tempdir().expect("tmp");
    let local = tmp.path().join("in.txt");
    std::fs::write(&local, b"copied in\n").expect("write");
    let o = sbx(
        &d,
        &[
            "cp",
            local.to_str().expect("utf8"),
            &format!("{id}:dir/in.txt"),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let o = sbx(&d, &["exec", &id, "--", "cat", "/work/dir/in.txt"]);
    assert_eq!(stdout(&o), "copied in\n");
    let back = tmp.path().join("back.txt");
    let o = sbx(
        &d,
        &[
            "cp",
            &format!("{id}:/work/dir/in.txt"),
            back.to_str().expect("utf8"),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    assert_eq!(std::fs::read(&back).expect("read"), b"copied in\n");
    // ls shows it; rm kills it; a bad id is an error with a message.
    let o = sbx(&d, &["ls"]);
    assert!(
        stdout(&o).contains(&id) && stdout(&o).contains("running"),
        "{}",
        stdout(&o)
    );
    let o = sbx(&d, &["rm", &id]);
    assert!(o.status.success(), "{o:?}");
    let o = sbx(&d, &["ls", "--status", "killed"]);
    assert!(stdout(&o).contains(&id));
    let o = sbx(&d, &["exec", &id, "--", "true"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("409"), "{o:?}");
    // `sbx run -- cmd` creates, runs and (with --rm) removes.
    let o = sbx(&d, &["run", "--rm", "--", "sh", "-c", "hostname; exit 5"]);
    assert_eq!(o.status.code(), Some(5), "{o:?}");
    assert_eq!(stdout(&o).trim().len(), 26);
    // Without the token the daemon refuses.
    let o = Command::new(bin())
        .args(["ls"])
        .env("SBX_URL", d.url(""))
        .env("SBX_TOKEN", "wrong")
        .output()
        .expect("run sbx");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("401"), "{o:?}");
}
