//! Image resolution for the daemon: the built-in `host` image. Registry
//! images arrive with the layer store.

use crate::runs::sandbox::Root;

pub struct Images {}

impl Images {
    pub fn new() -> Images {
        Images {}
    }

    /// The root a run of `image` gets; an error is a 422 for the client.
    pub async fn root_for(&self, image: &str) -> Result<Root, String> {
        if image == crate::runs::model::HOST_IMAGE {
            return Ok(Root::Host);
        }
        Err(format!(
            "image {image:?} is not available: this daemon has no registry image store yet; use \"host\""
        ))
    }
}
