//! Per-sandbox bandwidth: a token bucket filter (`tbf`) on both ends of a sandbox's veth pair,
//! set when the namespace is prepared.
//!
//! A sandbox that floods the network costs the host more than its own CPU quota shows: every
//! packet it sends is forwarded, filtered, tracked and NATed by the host's stack in softirq
//! context, which runs on whichever task the CPU happens to be on (the server included) or in
//! `ksoftirqd`, outside the sandbox's cgroup. Capping the rate at the sandbox's own interface
//! caps that work: packets over the rate are dropped as the sandbox enqueues them, on its own
//! CPU time. The sandbox's egress is shaped on `eth0` inside its namespace, and traffic to it on
//! the host end. The namespace belongs to the host's user namespace, so sandbox root holds no
//! `CAP_NET_ADMIN` over it and cannot remove either qdisc.
//!
//! netlink-packet-route has no type for `tbf`, so its options (`struct tc_tbf_qopt` and the
//! `TCA_TBF_*` attributes of `linux/pkt_sched.h`) are encoded here.

use futures_util::StreamExt;
use rtnetlink::Handle;
use rtnetlink::packet_core::{
    DefaultNla, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::tc::{TcAttribute, TcHandle, TcMessage, TcOption};

const TCA_TBF_PARMS: u16 = 1;
const TCA_TBF_RATE64: u16 = 4;
const TCA_TBF_BURST: u16 = 6;
/// Rates are given for Ethernet frames; anything else makes the kernel look for a rate table.
const TC_LINKLAYER_ETHERNET: u8 = 1;
/// `sizeof(struct tc_ratespec)`.
const RATESPEC_LEN: usize = 12;

/// The largest packet the stack hands a veth (a 64 KiB GSO packet plus the headers of each of
/// its segments). A bucket smaller than this would make tbf cut such packets into segments in
/// software, which costs more CPU than the shaping saves.
const MIN_BURST: u64 = 128 << 10;
/// The size every packet is charged as at least. The host's work (forwarding, filtering,
/// connection tracking, NAT) is per packet, so a rate in bytes alone would let a flood of tiny
/// packets cost many times what the same rate of full-sized ones does; charging each as a full
/// Ethernet payload bounds packets per second at `rate / 1500`. A download still fits: its ACKs
/// (one per two segments) use about half the rate of the opposite direction.
const MIN_PACKET: u16 = 1500;
/// How long the queue may take to drain at the rate: long enough for TCP to keep the link busy,
/// short enough that a flooding sandbox's own traffic is not stuck behind its flood for long.
const QUEUE_MS: u64 = 25;

/// A rate limit for both directions of a sandbox's network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shaping {
    /// Bytes per second.
    rate: u64,
    /// Bytes that may leave at full speed after a quiet spell.
    burst: u32,
    /// Bytes queued before packets are dropped.
    limit: u32,
    /// Smallest size a packet is charged as.
    mpu: u16,
}

impl Shaping {
    /// A limit of `mbit` megabits per second; `None` for 0 (no shaping).
    pub fn from_mbit(mbit: u32) -> Option<Self> {
        if mbit == 0 {
            return None;
        }
        let rate = u64::from(mbit) * 1_000_000 / 8;
        let burst = (rate / 1000 * 4).max(MIN_BURST);
        let limit = burst + rate * QUEUE_MS / 1000;
        Some(Self {
            rate,
            burst: u32::try_from(burst).unwrap_or(u32::MAX),
            limit: u32::try_from(limit).unwrap_or(u32::MAX),
            mpu: MIN_PACKET,
        })
    }

    /// The rate in bits per second.
    pub fn bits_per_sec(&self) -> u64 {
        self.rate * 8
    }

    /// `TCA_OPTIONS` of a tbf qdisc with these parameters.
    fn options(&self) -> Vec<TcOption> {
        let mut parms = Vec::with_capacity(2 * RATESPEC_LEN + 12);
        // struct tc_ratespec rate
        parms.push(0); // cell_log: unused without a rate table
        parms.push(TC_LINKLAYER_ETHERNET);
        parms.extend_from_slice(&0u16.to_ne_bytes()); // overhead
        parms.extend_from_slice(&0i16.to_ne_bytes()); // cell_align
        parms.extend_from_slice(&self.mpu.to_ne_bytes());
        // Rates past 32 bits go in TCA_TBF_RATE64; the kernel then ignores this field.
        parms.extend_from_slice(&u32::try_from(self.rate).unwrap_or(u32::MAX).to_ne_bytes());
        // struct tc_ratespec peakrate: none
        parms.extend_from_slice(&[0; RATESPEC_LEN]);
        parms.extend_from_slice(&self.limit.to_ne_bytes());
        // buffer and mtu, in scheduler ticks: TCA_TBF_BURST replaces the first, and the second
        // matters only with a peak rate.
        parms.extend_from_slice(&0u32.to_ne_bytes());
        parms.extend_from_slice(&0u32.to_ne_bytes());
        let mut options = vec![
            TcOption::Other(DefaultNla::new(TCA_TBF_PARMS, parms)),
            TcOption::Other(DefaultNla::new(
                TCA_TBF_BURST,
                self.burst.to_ne_bytes().to_vec(),
            )),
        ];
        if self.rate > u64::from(u32::MAX) {
            options.push(TcOption::Other(DefaultNla::new(
                TCA_TBF_RATE64,
                self.rate.to_ne_bytes().to_vec(),
            )));
        }
        options
    }

    /// Makes a tbf with these parameters the root qdisc of link `index`, over `handle` (a
    /// netlink connection in the link's namespace).
    pub async fn apply(&self, handle: &Handle, index: u32) -> Result<(), rtnetlink::Error> {
        let mut message = TcMessage::with_index(
            i32::try_from(index)
                .map_err(|_| rtnetlink::Error::InvalidNla(format!("link index {index}")))?,
        );
        message.header.parent = TcHandle::ROOT;
        message.header.handle = TcHandle { major: 1, minor: 0 };
        message.attributes = vec![
            TcAttribute::Kind("tbf".to_owned()),
            TcAttribute::Options(self.options()),
        ];
        let mut request = NetlinkMessage::from(RouteNetlinkMessage::NewQueueDiscipline(message));
        request.header.flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
        let mut responses = handle.clone().request(request)?;
        while let Some(response) = responses.next().await {
            if let NetlinkPayload::Error(err) = response.payload {
                return Err(rtnetlink::Error::NetlinkError(err));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use futures_util::TryStreamExt;
    use rtnetlink::packet_core::{Nla, NlasIterator};

    /// A tbf's parameters as the kernel reports them.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) struct Tbf {
        pub bits_per_sec: u64,
        pub limit: u32,
        pub mpu: u16,
    }

    /// What a link's root qdisc is, read back from the kernel: its kind and, for a tbf, its
    /// parameters.
    pub(crate) async fn root_qdisc(handle: &Handle, index: u32) -> (String, Option<Tbf>) {
        let mut qdiscs = handle.clone().qdisc().get().index(index as i32).execute();
        while let Some(qdisc) = qdiscs.try_next().await.expect("qdisc dump") {
            // The kernel dumps every link's qdiscs whatever the index asked for.
            if qdisc.header.index != index as i32 || qdisc.header.parent != TcHandle::ROOT {
                continue;
            }
            let mut kind = String::new();
            let mut tbf = None;
            for attribute in &qdisc.attributes {
                match attribute {
                    TcAttribute::Kind(k) => kind = k.clone(),
                    // Options of kinds the crate does not know come back as one attribute
                    // holding the nested ones.
                    TcAttribute::Options(options) => {
                        for option in options {
                            let mut nested = vec![0; option.value_len()];
                            option.emit_value(&mut nested);
                            for nla in NlasIterator::new(&nested[..]) {
                                let nla = nla.expect("tbf attribute");
                                if nla.kind() != TCA_TBF_PARMS {
                                    continue;
                                }
                                let value = nla.value();
                                let u32_at = |at: usize| {
                                    u32::from_ne_bytes(
                                        value[at..at + 4].try_into().expect("4 bytes"),
                                    )
                                };
                                tbf = Some(Tbf {
                                    bits_per_sec: u64::from(u32_at(8)) * 8,
                                    limit: u32_at(2 * RATESPEC_LEN),
                                    mpu: u16::from_ne_bytes([value[6], value[7]]),
                                });
                            }
                        }
                    }
                    _ => {}
                }
            }
            return (kind, tbf);
        }
        ("none".to_owned(), None)
    }

    #[test]
    fn zero_means_no_shaping() {
        assert_eq!(Shaping::from_mbit(0), None);
    }

    #[test]
    fn the_bucket_holds_a_gso_packet_and_the_queue_drains_in_its_time() {
        let slow = Shaping::from_mbit(10).expect("10 mbit");
        assert_eq!(slow.bits_per_sec(), 10_000_000);
        assert_eq!(u64::from(slow.burst), MIN_BURST);
        assert_eq!(
            u64::from(slow.limit),
            MIN_BURST + 10_000_000 / 8 * QUEUE_MS / 1000
        );
        let fast = Shaping::from_mbit(40_000).expect("40 gbit");
        assert_eq!(u64::from(fast.burst), 5_000_000_000 / 1000 * 4);
        assert!(fast.limit > fast.burst);
    }

    #[test]
    fn options_encode_tc_tbf_qopt() {
        let shaping = Shaping::from_mbit(200).expect("200 mbit");
        let options = shaping.options();
        assert_eq!(options.len(), 2, "no 64-bit rate below 32 bits");
        let mut parms = vec![0; options[0].value_len()];
        options[0].emit_value(&mut parms);
        assert_eq!(options[0].kind(), TCA_TBF_PARMS);
        assert_eq!(parms.len(), 36, "sizeof(struct tc_tbf_qopt)");
        assert_eq!(parms[1], TC_LINKLAYER_ETHERNET);
        assert_eq!(&parms[6..8], &MIN_PACKET.to_ne_bytes());
        assert_eq!(&parms[8..12], &25_000_000u32.to_ne_bytes());
        assert_eq!(&parms[24..28], &shaping.limit.to_ne_bytes());
        assert_eq!(options[1].kind(), TCA_TBF_BURST);

        let fast = Shaping::from_mbit(100_000).expect("100 gbit").options();
        let mut parms = vec![0; fast[0].value_len()];
        fast[0].emit_value(&mut parms);
        assert_eq!(&parms[8..12], &u32::MAX.to_ne_bytes());
        assert_eq!(fast[2].kind(), TCA_TBF_RATE64);
    }
}
