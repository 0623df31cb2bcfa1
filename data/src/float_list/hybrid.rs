//! The RLE / bit-packed hybrid encoding of Parquet's levels and
//! dictionary indices, decoded run by run for the float-list fast path
//! (`float_list.rs`). Its input is untrusted: a malformed run ends the
//! fast path with a [`NotFast`] reason, never a panic or a huge buffer.

use bytes::Bytes;

use super::{NotFast, not_fast};

/// The bits a level up to `max` takes.
pub(super) fn bit_width(max: i16) -> u8 {
    (16 - (max as u16).leading_zeros()) as u8
}

/// A run of the RLE / bit-packed hybrid encoding, cut to what is asked.
pub(super) enum Run<'a> {
    Repeat(u32, usize),
    Values(&'a [u32]),
}

/// The RLE / bit-packed hybrid encoding (levels, dictionary indices).
pub(super) struct Hybrid {
    data: Bytes,
    at: usize,
    bit_width: u8,
    /// What is left of the current run.
    repeat: Option<(u32, usize)>,
    unpacked: Vec<u32>,
    unpacked_at: usize,
}

impl Hybrid {
    pub(super) fn new(data: Bytes, bit_width: u8) -> Self {
        Self {
            data,
            at: 0,
            bit_width,
            repeat: None,
            unpacked: Vec::new(),
            unpacked_at: 0,
        }
    }

    /// Calls `f(offset, run)` over the next `n` values, run by run.
    pub(super) fn for_each_run(
        &mut self,
        n: usize,
        mut f: impl FnMut(usize, Run<'_>) -> Result<(), NotFast>,
    ) -> Result<(), NotFast> {
        let mut done = 0;
        while done < n {
            let want = n - done;
            if let Some((value, count)) = &mut self.repeat {
                let k = want.min(*count);
                f(done, Run::Repeat(*value, k))?;
                *count -= k;
                if *count == 0 {
                    self.repeat = None;
                }
                done += k;
                continue;
            }
            if self.unpacked_at < self.unpacked.len() {
                let end = self.unpacked.len().min(self.unpacked_at + want);
                let k = end - self.unpacked_at;
                f(done, Run::Values(&self.unpacked[self.unpacked_at..end]))?;
                self.unpacked_at = end;
                done += k;
                continue;
            }
            self.next_run()?;
        }
        Ok(())
    }

    /// Appends the dictionary values of the next `n` indices.
    pub(super) fn lookup(
        &mut self,
        n: usize,
        dictionary: &[f32],
        out: &mut Vec<f32>,
    ) -> Result<(), NotFast> {
        let value = |i: u32| {
            dictionary
                .get(i as usize)
                .copied()
                .ok_or_else(|| not_fast(format!("dictionary index {i} out of range")))
        };
        self.for_each_run(n, |_, run| {
            match run {
                Run::Repeat(i, count) => {
                    let v = value(i)?;
                    out.extend(std::iter::repeat_n(v, count));
                }
                Run::Values(indices) => {
                    for &i in indices {
                        out.push(value(i)?);
                    }
                }
            }
            Ok(())
        })
    }

    fn next_run(&mut self) -> Result<(), NotFast> {
        let header = self.uleb128()?;
        let count = (header >> 1) as usize;
        if header & 1 == 0 {
            let width = (self.bit_width as usize).div_ceil(8);
            let bytes = self
                .data
                .get(self.at..self.at + width)
                .ok_or_else(|| not_fast("an RLE run ends early"))?;
            let mut le = [0u8; 4];
            le[..width].copy_from_slice(bytes);
            self.at += width;
            if count == 0 {
                return Err(not_fast("an empty RLE run"));
            }
            self.repeat = Some((u32::from_le_bytes(le), count));
        } else {
            // `count` groups of 8 values, `bit_width` bytes per group; the
            // last group may be cut short at the end of the data. The
            // header is untrusted: its count may overflow any product.
            let too_long = || not_fast("a bit-packed run longer than any page");
            let values = count.checked_mul(8).ok_or_else(too_long)?;
            let bits = values
                .checked_mul(self.bit_width as usize)
                .ok_or_else(too_long)?;
            let end = self
                .at
                .saturating_add(bits.div_ceil(8))
                .min(self.data.len());
            if count == 0 || end == self.at && self.bit_width > 0 {
                return Err(not_fast("an empty bit-packed run"));
            }
            if self.bit_width == 0 {
                // Values of no bits are all zero: a run, not a buffer as
                // long as the header claims.
                self.repeat = Some((0, values));
                return Ok(());
            }
            let packed = &self.data[self.at..end];
            self.unpacked.clear();
            self.unpacked_at = 0;
            let width = self.bit_width as usize;
            let mask = if width == 32 {
                u32::MAX as u64
            } else {
                (1u64 << width) - 1
            };
            let available = packed.len() * 8 / width.max(1);
            let values = if width == 0 {
                values
            } else {
                values.min(available)
            };
            self.unpacked.reserve(values);
            for i in 0..values {
                let bit = i * width;
                let byte = bit / 8;
                let mut window = [0u8; 8];
                match packed.get(byte..byte + 8) {
                    // Whole 8-byte windows but near the end (one fixed-size copy).
                    Some(whole) => window.copy_from_slice(whole),
                    None => {
                        let tail = packed.get(byte..).unwrap_or(&[]);
                        window[..tail.len()].copy_from_slice(tail);
                    }
                }
                let v = (u64::from_le_bytes(window) >> (bit % 8)) & mask;
                self.unpacked.push(v as u32);
            }
            self.at = end;
        }
        Ok(())
    }

    fn uleb128(&mut self) -> Result<u64, NotFast> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self
                .data
                .get(self.at)
                .ok_or_else(|| not_fast("the levels end early"))?;
            self.at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(not_fast("a run header is too long"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn hybrid_decodes_runs_and_bit_packed_groups() {
        // RLE run: header (3 << 1) = 6, value 5 (bit width 3 -> 1 byte).
        // Bit-packed: header (1 << 1) | 1 = 3, one group of 8 values 0..7 at
        // width 3: 0b10001000, 0b11000110, 0b11111010.
        let data = Bytes::from(vec![6, 5, 3, 0b1000_1000, 0b1100_0110, 0b1111_1010]);
        let mut h = Hybrid::new(data, 3);
        let mut seen = Vec::new();
        h.for_each_run(11, |at, run| {
            match run {
                Run::Repeat(v, n) => seen.extend(std::iter::repeat_n((at, v), n)),
                Run::Values(vs) => seen.extend(vs.iter().map(|&v| (at, v))),
            }
            Ok(())
        })
        .unwrap();
        let values: Vec<u32> = seen.iter().map(|(_, v)| *v).collect();
        assert_eq!(values, vec![5, 5, 5, 0, 1, 2, 3, 4, 5, 6, 7]);
        // Asking past the end is refused, not a panic.
        let mut h = Hybrid::new(Bytes::from(vec![6, 5]), 3);
        assert!(h.for_each_run(4, |_, _| Ok(())).is_err());
    }

    #[test]
    fn a_bit_packed_run_header_cannot_overflow_or_allocate_its_count() {
        fn uleb128(mut v: u64) -> Vec<u8> {
            let mut out = Vec::new();
            loop {
                let byte = (v & 0x7f) as u8;
                v >>= 7;
                if v == 0 {
                    out.push(byte);
                    return out;
                }
                out.push(byte | 0x80);
            }
        }
        let read = |count: u64, bit_width: u8| {
            let mut data = uleb128(count << 1 | 1);
            data.extend_from_slice(&[0xaa; 16]);
            let mut h = Hybrid::new(Bytes::from(data), bit_width);
            let mut seen = 0;
            h.for_each_run(100, |_, run| {
                seen += match run {
                    Run::Repeat(_, n) => n,
                    Run::Values(v) => v.len(),
                };
                Ok(())
            })
            .map(|()| seen)
        };
        // A count whose values overflow (found by the float_list fuzzer:
        // `count * 8` overflowed) is refused, whatever the bit width.
        for bit_width in [0, 1, 3] {
            assert!(read(u64::MAX >> 1, bit_width).is_err(), "{bit_width}");
        }
        // A huge count of zero-bit values is a run of zeros, not a buffer.
        assert_eq!(read(1 << 40, 0), Ok(100));
        // With bits per value, the data bounds the values: 16 bytes at 3
        // bits are 42 values, short of 100.
        assert!(read(1 << 40, 3).is_err());
    }
}
