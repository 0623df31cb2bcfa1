//! Jobs: the manifest, zombies after the end, restart, cancel, resubmit,
//! pause and resume, and what status and outputs report.

use crate::support::*;

#[tokio::test(start_paused = true)]
async fn completed_job_has_a_manifest_of_committed_outputs_only() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 30).await;
    let (a, _a_events) = register(&mut state, "a");
    let mut committed_objects: Vec<(String, OutputObject)> = Vec::new();

    // An attempt writes an object and gives its lease back without
    // committing it.
    let abandoned = leased(state.acquire(&a));
    let orphan = output(&abandoned, 0, BATCH).uri;
    write_object(&stores, &orphan).await;
    state
        .release(release(&a, &abandoned, None))
        .await
        .expect("release");

    for shard in 0..3 {
        let lease = leased(state.acquire(&a));
        // Written by a committing attempt but never committed: not part of
        // the result either, in staging or (copied there by a coordinator
        // that crashed before storing the record) in the output folder.
        let stray = output(&lease, 99, 0);
        write_object(&stores, &stray.uri).await;
        write_object(&stores, &committed(&stray).uri).await;
        let commits = if shard == 0 {
            vec![checkpoint(&a, &lease, 0, 3), last_checkpoint(&a, &lease, 3)]
        } else {
            vec![last_checkpoint(&a, &lease, 0)]
        };
        for commit in commits {
            for object in &commit.outputs {
                write_object(&stores, &object.uri).await;
                committed_objects.push((lease.shard.id.clone(), committed(object)));
            }
            state.commit(commit).await.expect("commit");
        }
        if shard < 2 {
            assert_eq!(state.get_job("j").expect("job").state, JobState::Running);
            assert!(
                stores
                    .get_json::<Manifest>(&job_layout("j").manifest())
                    .await
                    .expect("read")
                    .is_none()
            );
        }
    }

    let job = state.get_job("j").expect("job");
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.shards_done, 3);
    assert_eq!(
        job.manifest_uri.as_deref(),
        Some(job_layout("j").manifest().as_str())
    );
    assert_eq!(stored_status(&stores, "j").await.state, JobState::Succeeded);

    let manifest = stored_manifest(&stores, "j").await;
    let expected: Vec<ManifestEntry> = committed_objects
        .iter()
        .map(|(shard_id, o)| ManifestEntry::new(shard_id, o))
        .collect();
    assert_eq!(manifest.job_id, "j");
    assert_eq!(manifest.shards, 3);
    assert_eq!(manifest.records_in, 30);
    assert_eq!(manifest.records_out, 30);
    assert_eq!(manifest.outputs, expected);

    // Only committed objects are left under the output prefix.
    let left: BTreeSet<String> = stores
        .list(&job_layout("j").default_output())
        .await
        .expect("list outputs")
        .into_iter()
        .map(|l| l.uri.to_string())
        .collect();
    let kept: BTreeSet<String> = committed_objects
        .iter()
        .map(|(_, o)| o.uri.clone())
        .collect();
    assert_eq!(left, kept);
    assert!(!left.contains(&committed(&output(&abandoned, 0, BATCH)).uri));

    // The staging folder, where attempts uploaded, is swept off the loop.
    let staging = job_layout("j").staging().join("/");
    assert!(
        !stores
            .list(&staging)
            .await
            .expect("list staging")
            .is_empty()
    );
    assert_eq!(state.take_sweeps(), vec![staging.clone()]);
    stoke_coordinator::sweep::sweep(&stores, &staging)
        .await
        .expect("sweep");
    assert!(
        stores
            .list(&staging)
            .await
            .expect("list staging")
            .is_empty()
    );
}

#[tokio::test(start_paused = true)]
async fn a_zombie_commit_after_the_end_is_refused_and_its_staging_swept() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let zombie = leased(state.acquire(&a));
    advance(lease_timeout() + Duration::from_millis(1)).await;
    state.heartbeat(&b, &[]).expect("b heartbeat");
    state.tick().await;
    let live = leased(state.acquire(&b));
    assert!(
        !state
            .commit(staged(&stores, last_checkpoint(&b, &live, 0)).await)
            .await
            .expect("live commit")
    );
    assert_eq!(state.get_job("j").expect("job").state, JobState::Succeeded);
    let staging = job_layout("j").staging().join("/");
    assert_eq!(state.take_sweeps(), vec![staging]);

    // The zombie wakes, uploads, and commits: refused, and what it staged
    // is garbage to sweep; the output folder holds the live commit only.
    let late = staged(&stores, last_checkpoint(&a, &zombie, 0)).await;
    let err = state.commit(late.clone()).await.expect_err("job ended");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::JobNotRunning { .. })
        ),
        "{err}"
    );
    let attempt = zombie.output_prefix.join("/");
    assert_eq!(state.take_sweeps(), vec![attempt.clone()]);
    stoke_coordinator::sweep::sweep(&stores, &attempt)
        .await
        .expect("sweep");
    assert!(stores.list(&attempt).await.expect("list").is_empty());
    let outputs: Vec<String> = stores
        .list(&job_layout("j").default_output().join("/"))
        .await
        .expect("list outputs")
        .into_iter()
        .map(|l| l.uri.to_string())
        .collect();
    assert_eq!(
        outputs,
        vec![committed(&last_checkpoint(&b, &live, 0).outputs[0]).uri]
    );
}

#[tokio::test(start_paused = true)]
async fn restart_reloads_progress_and_fences_old_tokens() {
    let stores = Stores::new();
    let mut before = recover(&stores).await;
    submit(&mut before, &stores, "j", 30).await;
    let (a, _a_events) = register(&mut before, "a");
    let partial = leased(before.acquire(&a));
    before
        .commit(staged(&stores, checkpoint(&a, &partial, 0, 2)).await)
        .await
        .expect("commit");
    let done = leased(before.acquire(&a));
    before
        .commit(staged(&stores, last_checkpoint(&a, &done, 0)).await)
        .await
        .expect("finish shard");
    let untouched = leased(before.acquire(&a));
    let old_tokens = [partial.token, done.token, untouched.token];
    let old_epoch = before.epoch();
    drop(before);

    let mut after = recover(&stores).await;
    assert!(
        after.epoch() > old_epoch,
        "epoch {} after {old_epoch}",
        after.epoch()
    );
    let job = after.get_job("j").expect("job reloaded");
    assert_eq!(job.state, JobState::Running);
    assert_eq!(job.shards_done, 1);
    assert_eq!(job.shards_leased, 0);
    assert_eq!(job.records_done, 4 + SHARD_RECORDS);

    let (b, _b_events) = register(&mut after, "b");
    let resumed = leased(after.acquire(&b));
    assert_eq!(resumed.shard.id, partial.shard.id);
    assert_eq!(resumed.next_batch, 2);
    assert_eq!(resumed.records_done, 4);
    let fresh = leased(after.acquire(&b));
    assert_eq!(fresh.shard.id, untouched.shard.id);
    assert_eq!(fresh.next_batch, 0);
    assert!(
        matches!(after.acquire(&b).expect("acquire"), AcquireOutcome::Wait(_)),
        "the shard done before the restart is not leased again"
    );
    let max_old = old_tokens.into_iter().max().expect("tokens");
    for token in [resumed.token, fresh.token] {
        assert!(
            token > max_old,
            "token {token} after restart must exceed {max_old}"
        );
    }

    let err = after
        .commit(staged(&stores, checkpoint(&a, &partial, 2, 3)).await)
        .await
        .expect_err("commit with a token from before the restart");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::StaleToken { .. })
        ),
        "{err}"
    );
    after
        .commit(staged(&stores, last_checkpoint(&b, &resumed, 2)).await)
        .await
        .expect("resumed commit");
    let progress = stored_progress(&stores, "j", &resumed.shard.id).await;
    assert_eq!(progress.next_batch, SHARD_BATCHES);
    assert_eq!(progress.records, SHARD_RECORDS);
    assert_eq!(progress.outputs.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn cancel_revokes_leases_and_refuses_their_commits() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 100).await;
    let (a, mut a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    state
        .commit(staged(&stores, checkpoint(&a, &lease, 0, 1)).await)
        .await
        .expect("commit");

    let job = state.cancel("j", String::new()).await.expect("cancel");
    assert_eq!(job.state, JobState::Cancelled);
    assert_eq!(job.shards_leased, 0);
    assert_eq!(stored_status(&stores, "j").await.state, JobState::Cancelled);
    match a_events.try_recv().expect("revoke event") {
        SessionEvent::Revoke { leases, .. } => assert_eq!(leases, vec![lease.key()]),
        other => panic!("expected a revoke, got {other:?}"),
    }

    let err = state
        .commit(staged(&stores, checkpoint(&a, &lease, 1, 2)).await)
        .await
        .expect_err("commit after cancel");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::JobNotRunning { .. })
                | CoordinatorError::Machine(MachineError::StaleToken { .. })
        ),
        "{err}"
    );
    assert_eq!(
        stored_progress(&stores, "j", &lease.shard.id)
            .await
            .next_batch,
        1
    );
    assert_eq!(state.acquire(&a).expect("acquire"), AcquireOutcome::Idle);
    let again = state
        .cancel("j", "again".to_string())
        .await
        .expect("cancel again");
    assert_eq!(again.reason, job.reason, "a finished job keeps its reason");

    // The cancellation is durable.
    let mut state = recover(&stores).await;
    assert_eq!(state.get_job("j").expect("job").state, JobState::Cancelled);
    let (b, _b_events) = register(&mut state, "b");
    assert_eq!(state.acquire(&b).expect("acquire"), AcquireOutcome::Idle);
}

#[tokio::test(start_paused = true)]
async fn resubmitting_a_job_id_needs_the_same_spec() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 100).await;
    let (a, _a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    state
        .commit(staged(&stores, checkpoint(&a, &lease, 0, 2)).await)
        .await
        .expect("commit");

    let again = submit(&mut state, &stores, "j", 100).await;
    assert_eq!(again.job_id, "j");
    assert_eq!(
        again.records_done, 4,
        "the existing job is returned, not a new one"
    );
    assert_eq!(again, state.get_job("j").expect("job"));
    assert_eq!(state.list_jobs().len(), 1);

    let other = spec(50);
    let plan = plan_dataset(&other, &stores).await.expect("plan");
    let err = state
        .create_job("j".to_string(), other.clone(), plan.clone())
        .await
        .expect_err("different spec");
    assert!(
        matches!(err, CoordinatorError::Machine(MachineError::JobExists { ref job_id }) if job_id == "j"),
        "{err}"
    );

    // The same holds after a restart, and the stored spec is untouched.
    let mut state = recover(&stores).await;
    let err = state
        .create_job("j".to_string(), other, plan)
        .await
        .expect_err("different spec after restart");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::JobExists { .. })
        ),
        "{err}"
    );
    assert_eq!(submit(&mut state, &stores, "j", 100).await.records_done, 4);
    let stored: JobSpec = stores
        .get_json(&job_layout("j").spec())
        .await
        .expect("read spec")
        .expect("spec exists");
    assert_eq!(stored, spec(100));
}

#[tokio::test(start_paused = true)]
async fn pause_drains_leases_and_resume_continues_from_checkpoints() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 20).await;
    let (a, mut a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    state
        .commit(staged(&stores, checkpoint(&a, &lease, 0, 2)).await)
        .await
        .expect("commit");

    let job = state
        .pause("j", "maintenance".to_string())
        .await
        .expect("pause");
    assert_eq!(job.state, JobState::Paused);
    assert_eq!(stored_status(&stores, "j").await.state, JobState::Paused);
    match a_events.try_recv().expect("drain event") {
        SessionEvent::Drain { leases, reason } => {
            assert_eq!(leases, vec![lease.key()]);
            assert_eq!(reason, "maintenance");
        }
        other => panic!("expected a drain, got {other:?}"),
    }
    // The holder may still checkpoint, then releases; nothing new is leased,
    // and workers are told to wait, not that there is no work.
    state
        .commit(staged(&stores, checkpoint(&a, &lease, 2, 3)).await)
        .await
        .expect("checkpoint while draining");
    state
        .release(release(&a, &lease, None))
        .await
        .expect("release");
    assert!(matches!(state.acquire(&a), Ok(AcquireOutcome::Wait(_))));

    // Paused survives a restart.
    let mut state = recover(&stores).await;
    assert_eq!(state.get_job("j").expect("job").state, JobState::Paused);
    let (b, _b_events) = register(&mut state, "b");
    assert!(matches!(state.acquire(&b), Ok(AcquireOutcome::Wait(_))));

    let job = state.resume("j").await.expect("resume");
    assert_eq!(job.state, JobState::Running);
    let mut next_batches = BTreeSet::new();
    for _ in 0..2 {
        let l = leased(state.acquire(&b));
        next_batches.insert((l.shard.id.clone(), l.next_batch));
    }
    assert!(
        next_batches.contains(&(lease.shard.id.clone(), 3)),
        "{next_batches:?}"
    );
    assert!(matches!(state.acquire(&b), Ok(AcquireOutcome::Wait(_))));
    // Resuming a running job changes nothing; a cancelled one cannot resume.
    assert_eq!(
        state.resume("j").await.expect("resume").state,
        JobState::Running
    );
    state.cancel("j", String::new()).await.expect("cancel");
    assert!(matches!(
        state.resume("j").await,
        Err(CoordinatorError::Machine(
            MachineError::JobNotRunning { .. }
        ))
    ));
    assert!(matches!(
        state.pause("j", String::new()).await,
        Err(CoordinatorError::Machine(
            MachineError::JobNotRunning { .. }
        ))
    ));
}

#[tokio::test(start_paused = true)]
async fn status_reports_shards_by_state_and_a_rate_from_samples_over_time() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 4 * SHARD_RECORDS).await;
    let (a, _a_events) = register(&mut state, "a");
    let report = state.status();
    let job = &report.jobs[0];
    assert_eq!(job.info.job_id, "j");
    assert_eq!(
        (
            job.shards.done,
            job.shards.leased,
            job.shards.retrying,
            job.shards.pending
        ),
        (0, 0, 0, 4)
    );
    assert_eq!((job.records_per_s, job.eta), (None, None));

    // One shard done, one half done and still leased, ten seconds on.
    let first = leased(state.acquire(&a));
    write_object(&stores, &output(&first, 0, SHARD_RECORDS).uri).await;
    state
        .commit(staged(&stores, last_checkpoint(&a, &first, 0)).await)
        .await
        .expect("commit");
    let second = leased(state.acquire(&a));
    write_object(&stores, &output(&second, 0, 4).uri).await;
    state
        .commit(staged(&stores, checkpoint(&a, &second, 0, 2)).await)
        .await
        .expect("commit");
    advance(Duration::from_secs(10)).await;
    let report = state.status();
    let job = &report.jobs[0];
    assert_eq!(job.info.records_done, SHARD_RECORDS + 4);
    assert_eq!(
        (
            job.shards.done,
            job.shards.leased,
            job.shards.retrying,
            job.shards.pending
        ),
        (1, 1, 0, 2)
    );
    // 14 records in 10 s; 26 left.
    assert_eq!(job.records_per_s, Some(1.4));
    let eta = job.eta.expect("eta").as_secs_f64();
    assert!((eta - 26.0 / 1.4).abs() < 1e-9, "{eta}");
    let worker = &report.snapshot.workers[0];
    assert_eq!(
        worker.leases,
        vec![("j".to_string(), second.shard.id.clone(), second.token)]
    );

    // A failed attempt: that shard waits as retrying, and is counted.
    state
        .release(release(&a, &second, Some("bad tensor shape")))
        .await
        .expect("release");
    let job = &state.status().jobs[0];
    assert_eq!(
        (
            job.shards.done,
            job.shards.leased,
            job.shards.retrying,
            job.shards.pending
        ),
        (1, 0, 1, 2)
    );
    assert_eq!(job.attempts_failed, 1);
    // Leased again (with the rest, by another worker), it is leased.
    let (b, _b_events) = register(&mut state, "b");
    let mut ids: Vec<String> = (0..3).map(|_| leased(state.acquire(&b)).shard.id).collect();
    ids.sort();
    assert!(ids.contains(&second.shard.id), "{ids:?}");
    let job = &state.status().jobs[0];
    assert_eq!(
        (
            job.shards.done,
            job.shards.leased,
            job.shards.retrying,
            job.shards.pending
        ),
        (1, 3, 0, 0)
    );

    // Nothing moves for a whole window: no rate, no ETA.
    advance(Duration::from_secs(31)).await;
    state.tick().await;
    advance(Duration::from_secs(5)).await;
    let job = &state.status().jobs[0];
    assert_eq!(job.records_per_s, Some(0.0));
    assert_eq!(job.eta, None);

    // A paused job has no rate.
    state.pause("j", String::new()).await.expect("pause");
    let job = &state.status().jobs[0];
    assert_eq!((job.records_per_s, job.eta), (None, None));
}

/// A job whose plan could not count its records (a JSON Lines dataset too
/// large to count at submit): its total is known once it succeeded, and
/// `stoke outputs` lists what it committed so far.
#[tokio::test(start_paused = true)]
async fn an_uncounted_job_knows_its_total_once_done_and_lists_its_outputs() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let spec = spec(20);
    let mut plan = plan_dataset(&spec, &stores).await.expect("plan");
    plan.records_total = None;
    for shard in &mut plan.shards {
        shard.records = None;
    }
    state
        .create_job("j".to_string(), spec, plan)
        .await
        .expect("create job");
    assert_eq!(state.get_job("j").expect("job").records_total, None);
    assert!(listed(state.job_outputs("j").expect("outputs")).is_empty());
    let (a, _events) = register(&mut state, "a");
    let mut committed = Vec::new();
    for _ in 0..2 {
        let lease = leased(state.acquire(&a));
        let commit = last_checkpoint(&a, &lease, 0);
        for object in &commit.outputs {
            write_object(&stores, &object.uri).await;
            committed.push((
                lease.shard.id.clone(),
                crate::support::committed(object).uri,
            ));
        }
        state.commit(commit).await.expect("commit");
        let outputs: Vec<(String, String)> = listed(state.job_outputs("j").expect("outputs"))
            .into_iter()
            .map(|o| (o.shard_id, o.object.uri))
            .collect();
        assert_eq!(outputs, committed);
        let job = state.get_job("j").expect("job");
        if job.state == JobState::Running {
            assert_eq!(job.records_total, None, "unknown until the end");
        }
    }
    let job = state.get_job("j").expect("job");
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.records_total, Some(20));
    // Still known once its shards have left memory (the tick after the
    // one that stores its report).
    state.tick().await;
    state.tick().await;
    assert_eq!(state.shards_in_memory(), 0);
    assert_eq!(state.get_job("j").expect("job").records_total, Some(20));
    assert!(matches!(
        state.job_outputs("nope"),
        Err(MachineError::JobNotFound { .. })
    ));
}

/// A succeeded job lets go of its plan and its shards' states once its
/// end is stored, and answers as before: its info, its errors, its report
/// and (from the manifest) its outputs; a zombie's commit is refused and
/// swept, a stale release and heartbeat change nothing. A restarted
/// coordinator loads only its summary (`ended.json`).
#[tokio::test(start_paused = true)]
async fn a_succeeded_job_lets_go_of_its_shards_and_answers_as_before() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 30).await;
    submit(&mut state, &stores, "other", 20).await;
    let (a, _a_events) = register(&mut state, "a");
    // One attempt fails, so the job has errors to show.
    let failed = leased(state.acquire(&a));
    state
        .release(release(&a, &failed, Some("CUDA out of memory")))
        .await
        .expect("release");
    let mut leases = vec![failed.clone()];
    while state.get_job("j").expect("job").state == JobState::Running {
        let lease = leased(state.acquire(&a));
        if lease.key().job_id == "j" {
            state
                .commit(staged(&stores, last_checkpoint(&a, &lease, 0)).await)
                .await
                .expect("commit");
            leases.push(lease);
        } else {
            state
                .release(release(&a, &lease, None))
                .await
                .expect("release");
        }
    }
    assert_eq!(state.get_job("j").expect("job").state, JobState::Succeeded);
    // Before the tick that lets go: 3 shards of j, 2 of the other job.
    assert_eq!(state.shards_in_memory(), 5);
    let info = state.get_job("j").expect("job");
    let errors = state.job_errors("j").expect("errors");
    assert_eq!(errors.shards.len(), 1, "{errors:?}");
    let outputs = listed(state.job_outputs("j").expect("outputs"));
    assert_eq!(outputs.len(), 3);
    let report = state.report("j", now()).expect("report");

    // The first tick stores its report; the next lets go.
    state.tick().await;
    assert_eq!(state.shards_in_memory(), 5, "its report not stored yet");
    state.tick().await;
    assert_eq!(state.shards_in_memory(), 2, "only the running job's");
    assert_eq!(state.get_job("j").expect("job"), info);
    let after = state.job_errors("j").expect("errors");
    assert_eq!(after.shards, errors.shards);
    assert_eq!(after.objects, errors.objects);
    let report_after = state.report("j", now()).expect("report");
    assert_eq!(report_after.seconds, report.seconds);
    assert_eq!(report_after.shards_split, report.shards_split);
    assert_eq!(
        report_after.wall_s, report.wall_s,
        "the clock stopped at the end"
    );
    match state.job_outputs("j").expect("outputs") {
        JobOutputs::InManifest(uri) => {
            assert_eq!(uri, job_layout("j").manifest());
            let manifest: Manifest = stores
                .get_json(&uri)
                .await
                .expect("read")
                .expect("the manifest");
            assert_eq!(manifest.outputs, outputs);
        }
        JobOutputs::Listed(_) => panic!("the succeeded job still lists from memory"),
    }

    // A zombie of the failed attempt commits: refused, its upload swept.
    state.take_sweeps();
    let late = staged(&stores, last_checkpoint(&a, &failed, 0)).await;
    let err = state.commit(late).await.expect_err("job ended");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::JobNotRunning { .. })
        ),
        "{err}"
    );
    let attempt = failed.output_prefix.join("/");
    assert_eq!(state.take_sweeps(), vec![attempt]);
    // A stale release and heartbeat: nothing to do.
    state
        .release(release(&a, &leases[1], None))
        .await
        .expect("a stale release is fine");
    state.heartbeat(&a, &[leases[1].key()]).expect("heartbeat");
    // The running job still leases and commits.
    let lease = leased(state.acquire(&a));
    assert_eq!(lease.key().job_id, "other");
    drop(state);

    // It left a summary: a restart loads that, not its plan and progress
    // (taken away here to show it).
    let ended: EndedRecord = stores
        .get_json(&job_layout("j").ended())
        .await
        .expect("read ended.json")
        .expect("ended.json written");
    assert_eq!((ended.shards_total, ended.shards_done), (3, 3));
    stores
        .delete(&job_layout("j").plan())
        .await
        .expect("delete plan.json");
    for object in stores
        .list(&job_layout("j").progress_dir())
        .await
        .expect("list progress")
    {
        stores.delete(&object.uri).await.expect("delete progress");
    }
    let mut restarted = recover(&stores).await;
    assert_eq!(restarted.shards_in_memory(), 2);
    let reloaded = restarted.get_job("j").expect("job");
    assert_eq!(
        (
            reloaded.state,
            reloaded.shards_total,
            reloaded.shards_done,
            reloaded.records_done
        ),
        (
            info.state,
            info.shards_total,
            info.shards_done,
            info.records_done
        )
    );
    assert!(matches!(
        restarted.job_outputs("j"),
        Ok(JobOutputs::InManifest(_))
    ));
    let reloaded_report = restarted.report("j", now()).expect("report");
    assert_eq!(reloaded_report.seconds, report.seconds);
    assert_eq!(reloaded_report.wall_s, report.wall_s);
    assert_eq!(reloaded_report.shards_split, report.shards_split);
    restarted.tick().await;
    assert_eq!(restarted.shards_in_memory(), 2);
    assert_eq!(restarted.get_job("j").expect("job").shards_total, 3);
    assert_eq!(
        restarted.job_errors("j").expect("errors").shards,
        errors.shards
    );
}

/// JSON Lines too large to count at plan time: no total, but once a shard
/// is done, an estimate from the plan's bytes at its bytes per record; the
/// ETA rests on it. A known total leaves no estimate.
#[tokio::test(start_paused = true)]
async fn a_total_not_counted_up_front_is_estimated_from_bytes() {
    use stoke_core::plan::{Plan, Shard, ShardSource};
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let spec = JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"jsonl\"\nuri = \"memory:///big.jsonl\"\nid_column = \"id\"\n\
         [processor]\nname = \"p\"\n[batching]\nbatch_size = {BATCH}\n"
    ))
    .expect("spec");
    // Four shards of 1,000 bytes, 4,000 in all; their records uncounted.
    let plan = Plan {
        shards: (0..4u64)
            .map(|i| Shard {
                id: format!("s{i:05}"),
                records: None,
                source: ShardSource::Jsonl {
                    uri: "memory:///big.jsonl".to_string(),
                    byte_start: i * 1_000,
                    byte_end: (i + 1) * 1_000,
                    first_line: None,
                },
                cut: None,
            })
            .collect(),
        records_total: None,
        jsonl_schema: None,
        incremental: None,
    };
    state
        .create_job("j".to_string(), spec, plan)
        .await
        .expect("create job");
    let info = |state: &mut Inline| {
        state
            .status()
            .jobs
            .into_iter()
            .find(|j| j.info.job_id == "j")
            .expect("the job")
    };
    let (a, _a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    // A checkpoint, no shard done: nothing to estimate from yet.
    let c = checkpoint(&a, &lease, 0, 2);
    state
        .commit(staged(&stores, c).await)
        .await
        .expect("commit");
    let job = info(&mut state);
    assert_eq!(job.info.records_total, None);
    assert_eq!(job.info.records_total_estimate, None);
    // The shard done: its 10 records in 1,000 bytes make 40 in 4,000.
    let done = last_checkpoint(&a, &lease, 2);
    state
        .commit(staged(&stores, done).await)
        .await
        .expect("commit");
    let job = info(&mut state);
    assert_eq!(job.info.records_done, SHARD_RECORDS);
    assert_eq!(job.info.records_total, None);
    assert_eq!(job.info.records_total_estimate, Some(4 * SHARD_RECORDS));
    assert!(job.info.eta_is_estimate());
}
