//! Between the KV transport's addresses and region descriptors and their gRPC messages
//! (`KvWorkerAddress`, `KvRegion`): the decode worker writes them into a `KvDestination`, the
//! prefill worker reads them back.

use std::net::SocketAddr;

use cleave_kv_transfer::{RegionDescriptor, RegionId, UcxRegionDescriptor, WorkerAddress};
use cleave_proto::v1 as pb;

/// A KV destination field that does not describe an address or a region.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum KvWireError {
    /// The message is absent.
    #[error("{0} is required")]
    Missing(String),
    /// A socket address that does not parse (it must be `ip:port`).
    #[error("{field}: {value:?} is not an ip:port address")]
    Addr {
        /// The field, e.g. `destination.region.owner`.
        field: String,
        /// What it held.
        value: String,
    },
}

/// The wire form of a transport address.
pub fn address_to_wire(a: &WorkerAddress) -> pb::KvWorkerAddress {
    pb::KvWorkerAddress {
        tcp: a.tcp.to_string(),
        ucx: a.ucx.clone(),
    }
}

/// The wire form of a region descriptor.
pub fn region_to_wire(d: &RegionDescriptor) -> pb::KvRegion {
    pb::KvRegion {
        owner: d.owner.to_string(),
        id: d.id.0,
        len: d.len,
        ucx: d.ucx.as_ref().map(|u| pb::UcxRegion {
            base: u.base,
            rkey: u.rkey.clone(),
        }),
    }
}

fn socket(field: &str, value: &str) -> Result<SocketAddr, KvWireError> {
    value.parse().map_err(|_| KvWireError::Addr {
        field: field.to_string(),
        value: value.to_string(),
    })
}

/// The transport address in `field` (named in errors, e.g. `destination.worker_address`).
pub fn address_from_wire(
    a: Option<&pb::KvWorkerAddress>,
    field: &str,
) -> Result<WorkerAddress, KvWireError> {
    let a = a.ok_or_else(|| KvWireError::Missing(field.to_string()))?;
    Ok(WorkerAddress {
        tcp: socket(&format!("{field}.tcp"), &a.tcp)?,
        ucx: a.ucx.clone(),
    })
}

/// The region descriptor in `field` (named in errors, e.g. `destination.region`).
pub fn region_from_wire(
    r: Option<&pb::KvRegion>,
    field: &str,
) -> Result<RegionDescriptor, KvWireError> {
    let r = r.ok_or_else(|| KvWireError::Missing(field.to_string()))?;
    Ok(RegionDescriptor {
        owner: socket(&format!("{field}.owner"), &r.owner)?,
        id: RegionId(r.id),
        len: r.len,
        ucx: r.ucx.as_ref().map(|u| UcxRegionDescriptor {
            base: u.base,
            rkey: u.rkey.clone(),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_regions_round_trip() {
        let a = WorkerAddress {
            tcp: "127.0.0.1:7000".parse().unwrap(),
            ucx: Some(vec![1, 2, 3]),
        };
        let w = address_to_wire(&a);
        assert_eq!(address_from_wire(Some(&w), "a"), Ok(a));
        let d = RegionDescriptor {
            owner: "[::1]:7001".parse().unwrap(),
            id: RegionId(u64::MAX),
            len: 4096,
            ucx: Some(UcxRegionDescriptor {
                base: 0xdead_0000,
                rkey: vec![9; 40],
            }),
        };
        let w = region_to_wire(&d);
        assert_eq!(region_from_wire(Some(&w), "r"), Ok(d.clone()));
        let plain = RegionDescriptor { ucx: None, ..d };
        assert_eq!(
            region_from_wire(Some(&region_to_wire(&plain)), "r"),
            Ok(plain)
        );
    }

    #[test]
    fn a_bad_or_missing_field_is_named() {
        assert_eq!(
            address_from_wire(None, "destination.worker_address")
                .unwrap_err()
                .to_string(),
            "destination.worker_address is required"
        );
        let bad = pb::KvRegion {
            owner: "decode-0:7000".into(),
            ..Default::default()
        };
        let e = region_from_wire(Some(&bad), "destination.region").unwrap_err();
        assert_eq!(
            e,
            KvWireError::Addr {
                field: "destination.region.owner".into(),
                value: "decode-0:7000".into()
            }
        );
    }
}
