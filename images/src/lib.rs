//! Images: the built-in `host` image, registry pulls into a
//! content-addressed layer store, safe layer unpacking, and overlay assembly.

pub mod host;
pub mod overlay;
pub mod store;
pub mod unpack;
