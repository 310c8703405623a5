use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use oci_spec::runtime::LinuxDeviceCgroup;

use super::controller::Controller;
use crate::common::{ControllerOpt, WrappedIoError, default_allow_devices, default_devices};

pub struct Devices {}

impl Controller for Devices {
    type Error = WrappedIoError;
    type Resource = ();

    fn apply(controller_opt: &ControllerOpt, cgroup_root: &Path) -> Result<(), Self::Error> {
        tracing::debug!("Apply Devices cgroup config");

        let defaults: Vec<LinuxDeviceCgroup> = [
            default_devices().iter().map(|d| d.into()).collect(),
            default_allow_devices(),
        ]
        .concat();
        let spec = controller_opt.resources.devices().as_deref().unwrap_or_default();
        Self::apply_all(spec.iter().chain(defaults.iter()), cgroup_root)
    }

    // always needs to be called due to default devices
    fn needs_to_handle<'a>(_controller_opt: &'a ControllerOpt) -> Option<&'a Self::Resource> {
        Some(&())
    }
}

impl Devices {
    #[cfg(test)]
    fn apply_device(device: &LinuxDeviceCgroup, cgroup_root: &Path) -> Result<(), WrappedIoError> {
        Self::apply_all(std::iter::once(device), cgroup_root)
    }

    /// (sbx) Writes `rules` in order through one descriptor per file — the
    /// kernel takes one rule per write — instead of opening the file once
    /// per rule, and skips an allow rule already written since the last
    /// deny (the defaults repeat most of a spec's list).
    fn apply_all<'a>(
        rules: impl Iterator<Item = &'a LinuxDeviceCgroup>,
        cgroup_root: &Path,
    ) -> Result<(), WrappedIoError> {
        let (mut allow, mut deny) = (None, None);
        let mut allowed: Vec<String> = Vec::new();
        for device in rules {
            let line = device.to_string();
            if device.allow() {
                if allowed.contains(&line) {
                    continue;
                }
                write_rule(&mut allow, &cgroup_root.join("devices.allow"), &line)?;
                allowed.push(line);
            } else {
                write_rule(&mut deny, &cgroup_root.join("devices.deny"), &line)?;
                allowed.clear();
            }
        }
        Ok(())
    }
}

fn write_rule(file: &mut Option<File>, path: &Path, rule: &str) -> Result<(), WrappedIoError> {
    let f = match file {
        Some(f) => f,
        None => file.insert(
            fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|err| WrappedIoError::Open {
                    err,
                    path: path.to_path_buf(),
                })?,
        ),
    };
    f.write_all(rule.as_bytes())
        .map_err(|err| WrappedIoError::Write {
            err,
            path: path.to_path_buf(),
            data: rule.into(),
        })
}

#[cfg(test)]
mod tests {
    use std::fs::read_to_string;

    use oci_spec::runtime::{LinuxDeviceCgroupBuilder, LinuxDeviceType};

    use super::*;
    use crate::test::set_fixture;

    #[test]
    fn test_set_default_devices() {
        let tmp = tempfile::tempdir().unwrap();

        default_allow_devices().iter().for_each(|d| {
            // NOTE: We reset the fixtures every iteration because files aren't appended
            // so what happens in the tests is you get strange overwrites which can contain
            // remaining bytes from the last iteration. Resetting the files more appropriately
            // mocks the behavior of cgroup files.
            set_fixture(tmp.path(), "devices.allow", "").expect("create allowed devices list");
            set_fixture(tmp.path(), "devices.deny", "").expect("create denied devices list");

            Devices::apply_device(d, tmp.path()).expect("Apply default device");
            println!("Device: {}", d);
            if d.allow() {
                let allowed_content =
                    read_to_string(tmp.path().join("devices.allow")).expect("read to string");
                assert_eq!(allowed_content, d.to_string());
            } else {
                let denied_content =
                    read_to_string(tmp.path().join("devices.deny")).expect("read to string");
                assert_eq!(denied_content, d.to_string());
            }
        });
    }

    #[test]
    fn rules_go_in_order_through_one_descriptor_without_repeats_since_a_deny() {
        let tmp = tempfile::tempdir().unwrap();
        set_fixture(tmp.path(), "devices.allow", "").expect("allow");
        set_fixture(tmp.path(), "devices.deny", "").expect("deny");
        let rule = |allow: bool, major: i64| {
            LinuxDeviceCgroupBuilder::default()
                .allow(allow)
                .typ(LinuxDeviceType::C)
                .major(major)
                .minor(3)
                .access("rwm")
                .build()
                .unwrap()
        };
        let rules = [
            rule(true, 1),
            rule(true, 5),
            rule(true, 1),
            rule(false, 1),
            rule(true, 1),
            rule(true, 5),
            rule(true, 5),
        ];
        Devices::apply_all(rules.iter(), tmp.path()).expect("apply");
        // A fixture is a plain file: the writes through one descriptor
        // follow each other.
        assert_eq!(
            read_to_string(tmp.path().join("devices.allow")).unwrap(),
            "c 1:3 rwmc 5:3 rwmc 1:3 rwmc 5:3 rwm"
        );
        assert_eq!(
            read_to_string(tmp.path().join("devices.deny")).unwrap(),
            "c 1:3 rwm"
        );
    }

    #[test]
    fn test_set_mock_devices() {
        let tmp = tempfile::tempdir().unwrap();
        [
            LinuxDeviceCgroupBuilder::default()
                .allow(true)
                .typ(LinuxDeviceType::C)
                .major(10)
                .access("rwm")
                .build()
                .unwrap(),
            LinuxDeviceCgroupBuilder::default()
                .allow(true)
                .typ(LinuxDeviceType::A)
                .minor(200)
                .access("rwm")
                .build()
                .unwrap(),
            LinuxDeviceCgroupBuilder::default()
                .allow(false)
                .typ(LinuxDeviceType::P)
                .major(10)
                .minor(200)
                .access("m")
                .build()
                .unwrap(),
            LinuxDeviceCgroupBuilder::default()
                .allow(false)
                .typ(LinuxDeviceType::U)
                .access("rw")
                .build()
                .unwrap(),
        ]
        .iter()
        .for_each(|d| {
            set_fixture(tmp.path(), "devices.allow", "").expect("create allowed devices list");
            set_fixture(tmp.path(), "devices.deny", "").expect("create denied devices list");

            Devices::apply_device(d, tmp.path()).expect("Apply default device");
            println!("Device: {}", d);
            if d.allow() {
                let allowed_content =
                    read_to_string(tmp.path().join("devices.allow")).expect("read to string");
                assert_eq!(allowed_content, d.to_string());
            } else {
                let denied_content =
                    read_to_string(tmp.path().join("devices.deny")).expect("read to string");
                assert_eq!(denied_content, d.to_string());
            }
        });
    }

    quickcheck! {
        fn property_test_apply_device(device: LinuxDeviceCgroup) -> bool {
            let tmp = tempfile::tempdir().unwrap();
            set_fixture(tmp.path(), "devices.allow", "").expect("create allowed devices list");
            set_fixture(tmp.path(), "devices.deny", "").expect("create denied devices list");
            Devices::apply_device(&device, tmp.path()).expect("Apply default device");
            if device.allow() {
                let allowed_content =
                    read_to_string(tmp.path().join("devices.allow")).expect("read to string");
                allowed_content == device.to_string()
            } else {
                let denied_content =
                    read_to_string(tmp.path().join("devices.deny")).expect("read to string");
                denied_content == device.to_string()
            }
        }

        fn property_test_apply_multiple_devices(devices: Vec<LinuxDeviceCgroup>) -> bool {
            let tmp = tempfile::tempdir().unwrap();
            devices.iter()
                .all(|device| {
                    set_fixture(tmp.path(), "devices.allow", "").expect("create allowed devices list");
                    set_fixture(tmp.path(), "devices.deny", "").expect("create denied devices list");
                    Devices::apply_device(device, tmp.path()).expect("Apply default device");
                    if device.allow() {
                        let allowed_content =
                            read_to_string(tmp.path().join("devices.allow")).expect("read to string");
                        allowed_content == device.to_string()
                    } else {
                        let denied_content =
                            read_to_string(tmp.path().join("devices.deny")).expect("read to string");
                        denied_content == device.to_string()
                    }
                })
        }
    }
}
