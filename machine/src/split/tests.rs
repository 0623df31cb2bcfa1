//! The split point's arithmetic, without a state.

use super::*;

#[test]
fn the_split_point_leaves_the_in_flight_window_and_gives_a_part_of_the_rest() {
    // 1000 records, batches of 10, interval 2: nothing committed, the
    // holder may have 2 + 1 batches processed; of the 100 batches
    // left, half go to the new shard.
    let p = split_point(0, 1000, 0, 0, 10, 2, Share::HALF).expect("split");
    assert_eq!(
        p,
        SplitPoint {
            at: 500,
            first_batch: 50,
            records: 500
        }
    );
    // A shard made by a split, partly committed: offsets stay the
    // origin's and batch numbers go on from the committed ones.
    let p = split_point(530, 1000, 100, 63, 10, 2, Share::HALF).expect("split");
    // 37 batches left: 18 go, 19 stay.
    assert_eq!(p.at, 630 + 190);
    assert_eq!(p.first_batch, 63 + 19);
    assert_eq!(p.records, 1000 - p.at);
    // A short last batch counts as a batch.
    let p = split_point(0, 995, 0, 0, 10, 2, Share::HALF).expect("split");
    assert_eq!((p.at, p.records), (500, 495));
    // However large the part, the holder keeps its in-flight window.
    let p = split_point(0, 100, 0, 0, 10, 2, Share::Part(950)).expect("split");
    assert_eq!((p.at, p.records), (30, 70));
}

#[test]
fn a_worker_without_a_pace_is_trusted_with_a_probe() {
    // The asker has none: the floor (2 batches), from the end.
    assert_eq!(Share::of(None, Some(5.0)), Share::Probe);
    assert_eq!(Share::of(None, None), Share::Probe);
    let p = split_point(0, 1000, 0, 0, 10, 2, Share::Probe).expect("split");
    assert_eq!(
        p,
        SplitPoint {
            at: 980,
            first_batch: 98,
            records: 20
        }
    );
    // A short last batch: one batch more, so the probe holds the
    // floor's records.
    let p = split_point(0, 995, 0, 0, 10, 2, Share::Probe).expect("split");
    assert_eq!((p.at, p.records), (970, 25));
    // The holder has none: it keeps its window (3 batches) and a
    // probe (2), the asker takes the rest.
    assert_eq!(Share::of(Some(5.0), None), Share::LeaveProbe);
    let p = split_point(0, 1000, 0, 0, 10, 2, Share::LeaveProbe).expect("split");
    assert_eq!((p.at, p.first_batch, p.records), (50, 5, 950));
    let p = split_point(200, 1000, 300, 30, 10, 2, Share::LeaveProbe).expect("split");
    assert_eq!((p.at, p.records), (550, 450));
    // Too short for a probe past the window: no split.
    assert_eq!(split_point(0, 40, 0, 0, 10, 2, Share::Probe), None);
    assert!(split_point(0, 50, 0, 0, 10, 2, Share::Probe).is_some());
    assert_eq!(split_point(0, 60, 0, 0, 10, 2, Share::LeaveProbe), None);
    assert!(split_point(0, 70, 0, 0, 10, 2, Share::LeaveProbe).is_some());
}

#[test]
fn a_faster_asker_takes_more_and_a_slower_one_less() {
    let fast = Share::of(Some(4000.0), Some(1000.0));
    assert_eq!(fast, Share::Part(800));
    // 100 batches left: the new shard gets 80 of them.
    let p = split_point(0, 1000, 0, 0, 10, 2, fast).expect("split");
    assert_eq!((p.at, p.records), (200, 800));
    let slow = Share::of(Some(1000.0), Some(4000.0));
    assert_eq!(slow, Share::Part(200));
    let p = split_point(0, 1000, 0, 0, 10, 2, slow).expect("split");
    assert_eq!((p.at, p.records), (800, 200));
    // Too little for the floor: a slow asker does not split a short
    // remainder at all.
    assert_eq!(split_point(0, 90, 0, 0, 10, 2, slow), None);
    // Never all; a stalled worker (a pace of 0) is the slowest.
    assert_eq!(Share::of(Some(1e9), Some(1.0)), Share::Part(950));
    assert_eq!(Share::of(Some(10.0), Some(0.0)), Share::Part(950));
    assert_eq!(Share::of(Some(0.0), Some(10.0)), Share::Part(50));
    assert_eq!(Share::of(Some(0.0), Some(0.0)), Share::HALF);
    assert_eq!(Share::of(Some(f64::NAN), Some(1.0)), Share::Probe);
}

#[test]
fn an_asker_still_busy_gets_what_ends_with_the_holder() {
    // 2/3 of 180 records, less what the holder (20/s) does in the
    // 0.5 s the asker is busy: 2/3 of 170.
    let p = Share::Part(667).after(0.5, Some(20.0), 180);
    assert_eq!(p, Share::Part(630));
    // Busy for longer than the holder needs: nothing.
    assert_eq!(
        Share::Part(667).after(10.0, Some(20.0), 180),
        Share::Part(0)
    );
    assert_eq!(split_point(0, 1000, 0, 0, 10, 2, Share::Part(0)), None);
    assert_eq!(
        Share::Part(500).after(f64::INFINITY, Some(20.0), 180),
        Share::Part(0)
    );
    // Free now, or a probe: as it was.
    assert_eq!(
        Share::Part(667).after(0.0, Some(20.0), 180),
        Share::Part(667)
    );
    assert_eq!(Share::Probe.after(0.5, Some(20.0), 180), Share::Probe);
    assert_eq!(Share::LeaveProbe.after(0.5, None, 180), Share::LeaveProbe);
}

#[test]
fn no_split_below_the_floor() {
    // 3 in-flight batches, then the new shard needs the floor (2
    // batches).
    assert!(split_point(0, 50, 0, 0, 10, 2, Share::HALF).is_some());
    assert_eq!(split_point(0, 40, 0, 0, 10, 2, Share::HALF), None);
    assert_eq!(split_point(0, 1000, 990, 99, 10, 2, Share::HALF), None);
    // Committed past the end (a bad record count): no split.
    assert_eq!(split_point(0, 100, 200, 20, 10, 2, Share::HALF), None);
}

#[test]
fn the_shard_that_would_end_last_is_split_first() {
    // 1,000 records at 100/s end after 600 at 10/s; with no pace
    // known, records alone; a stalled holder never ends.
    assert!(ends_in(1000, Some(100.0)) < ends_in(600, Some(10.0)));
    assert_eq!(ends_in(600, None), 600.0);
    assert_eq!(ends_in(1, Some(0.0)), f64::INFINITY);
}
