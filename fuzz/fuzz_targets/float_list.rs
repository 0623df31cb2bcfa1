#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| stoke_fuzz::float_list(data));
