//! Feeds arbitrary bytes to the frame decoder, with and without a valid envelope.
//!
//! Invariants: nothing panics; an invalid or incomplete frame leaves the buffer untouched;
//! an f32 or empty payload that decodes re-encodes to the same bytes (postcard payloads
//! need not: postcard accepts non-shortest varints and re-encodes them shortest).

#![no_main]

use bytes::BytesMut;
use elasticps_wire::{CHECKSUM_OFFSET, Codec, HEADER_LEN, MAGIC, Message, VERSION, checksum};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let codec = Codec::new(b"fuzz", 1 << 16);
    // 1. Raw bytes, as a hostile peer would send them.
    drain(&codec, BytesMut::from(data));
    // 2. The same bytes behind a valid magic, version and checksum, so that the kind,
    //    length rules and payload decoders (postcard) see them.
    if data.len() >= HEADER_LEN - 6 {
        let mut head = [0u8; HEADER_LEN];
        head[..4].copy_from_slice(&MAGIC);
        head[4] = VERSION;
        head[5..CHECKSUM_OFFSET].copy_from_slice(&data[..CHECKSUM_OFFSET - 5]);
        let rest = &data[CHECKSUM_OFFSET - 5..];
        head[24..28].copy_from_slice(&(rest.len() as u32).to_le_bytes());
        let sum = checksum(&head, b"fuzz");
        head[CHECKSUM_OFFSET..].copy_from_slice(&sum.to_le_bytes());
        let mut buf = BytesMut::from(&head[..]);
        buf.extend_from_slice(rest);
        drain(&codec, buf);
    }
});

fn drain(codec: &Codec, mut buf: BytesMut) {
    loop {
        let before = buf.len();
        match codec.decode_frame(&mut buf) {
            Ok(Some((h, payload))) => {
                if let Ok(msg) = Message::decode(&h, payload.clone())
                    && !h.kind.is_postcard()
                {
                    let (_, again) = codec.encode(h.request_id, &msg).expect("re-encode");
                    assert_eq!(again, payload, "decode/encode is not the identity");
                }
            }
            Ok(None) | Err(_) => {
                assert_eq!(
                    buf.len(),
                    before,
                    "a failed or incomplete decode consumed bytes"
                );
                return;
            }
        }
    }
}
