//! The membership part of [`CosmosLeaseStore`]: heartbeat rows, the membership read and the
//! membership view, beside the lease rows of the parent module.

use super::*;
use changefeed::lease::MembershipStore;

#[async_trait]
impl MembershipStore for CosmosLeaseStore {
    async fn heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
        role: HeartbeatRole,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        match role {
            HeartbeatRole::Member => {
                let version = expected.map_or(Version::FIRST, Version::next);
                let doc = heartbeat_doc(group, host, incarnation, written_at, version, report);
                let stored = Heartbeat {
                    group: group.clone(),
                    host: host.clone(),
                    incarnation: incarnation.into(),
                    version,
                    written_at,
                    report: report.map(Into::into),
                };
                let name = || Some(format!("{group}/{host}"));
                let slot = (group.clone(), host.clone());
                let Some(expected) = expected else {
                    let answer = self
                        .rest
                        .create(group.as_str(), &doc)
                        .await
                        .map_err(|e| e.into_lease("heartbeat", name()))?;
                    return match answer.status {
                        200 | 201 => {
                            let etag = answer.json().ok().and_then(|b| etag_of(&answer, &b).ok());
                            if let Some(etag) = etag {
                                lock(&self.inner.hosts).insert(slot, (version, etag));
                            }
                            Ok(stored)
                        }
                        409 => {
                            let current = self.read_heartbeat("heartbeat", group, host).await?;
                            Err(Self::heartbeat_conflict(
                                group,
                                host,
                                current.map(|(h, _)| h),
                            ))
                        }
                        _ => Err(answer.into_error().into_lease("heartbeat", name())),
                    };
                };
                for _ in 0..SAME_VERSION_ATTEMPTS {
                    let known = lock(&self.inner.hosts)
                        .get(&slot)
                        .filter(|(v, _)| *v == expected)
                        .map(|(_, etag)| etag.clone());
                    let etag = match known {
                        Some(etag) => etag,
                        None => match self.read_heartbeat("heartbeat", group, host).await? {
                            None => return Err(Self::heartbeat_conflict(group, host, None)),
                            Some((current, _)) if current.version != expected => {
                                return Err(Self::heartbeat_conflict(group, host, Some(current)))
                            }
                            Some((_, etag)) => etag,
                        },
                    };
                    let answer = self
                        .rest
                        .replace(group.as_str(), &host_id(host.as_str()), &doc, &etag)
                        .await
                        .map_err(|e| e.into_lease("heartbeat", name()))?;
                    match answer.status {
                        200 | 201 => {
                            let etag = answer.json().ok().and_then(|b| etag_of(&answer, &b).ok());
                            match etag {
                                Some(etag) => lock(&self.inner.hosts).insert(slot, (version, etag)),
                                None => lock(&self.inner.hosts).remove(&slot),
                            };
                            return Ok(stored);
                        }
                        404 => {
                            lock(&self.inner.hosts).remove(&slot);
                            return Err(Self::heartbeat_conflict(group, host, None));
                        }
                        412 => {
                            lock(&self.inner.hosts).remove(&slot);
                        }
                        _ => return Err(answer.into_error().into_lease("heartbeat", name())),
                    }
                }
                let current = self.read_heartbeat("heartbeat", group, host).await?;
                Err(Self::heartbeat_conflict(
                    group,
                    host,
                    current.map(|(h, _)| h),
                ))
            }
            HeartbeatRole::Leader => {
                self.put_lead_heartbeat(group, host, incarnation, written_at, expected, report)
                    .await
            }
        }
    }

    async fn remove_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        expected: Version,
    ) -> Result<(), LeaseError> {
        let name = || Some(format!("{group}/{host}"));
        let slot = (group.clone(), host.clone());
        for _ in 0..SAME_VERSION_ATTEMPTS {
            let Some((current, etag)) =
                self.read_heartbeat("remove_heartbeat", group, host).await?
            else {
                return Ok(());
            };
            if current.version != expected || &*current.incarnation != incarnation {
                return Err(Self::heartbeat_conflict(group, host, Some(current)));
            }
            let answer = self
                .rest
                .delete(group.as_str(), &host_id(host.as_str()), Some(&etag))
                .await
                .map_err(|e| e.into_lease("remove_heartbeat", name()))?;
            match answer.status {
                200 | 204 | 404 => {
                    lock(&self.inner.hosts).remove(&slot);
                    return Ok(());
                }
                // Written again since it was read: look again.
                412 => {}
                _ => return Err(answer.into_error().into_lease("remove_heartbeat", name())),
            }
        }
        let current = self.read_heartbeat("remove_heartbeat", group, host).await?;
        Err(Self::heartbeat_conflict(
            group,
            host,
            current.map(|(h, _)| h),
        ))
    }

    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError> {
        let docs = self
            .rest
            .query_all(
                group.as_str(),
                "SELECT * FROM c WHERE c.group = @g AND (STARTSWITH(c.id, @p) OR c.id = @counter)",
                &[
                    ("@g", group.as_str().into()),
                    ("@p", HOST_PREFIX.into()),
                    ("@counter", COUNTER_ID.into()),
                ],
                self.inner.page_size,
            )
            .await
            .map_err(|e| e.into_lease("membership", Some(group.to_string())))?;
        let mut membership = Membership::default();
        for doc in &docs {
            let etag = body_etag(doc).unwrap_or_default();
            if doc.get("id").and_then(Value::as_str) == Some(COUNTER_ID) {
                let counter = CounterDoc::parse(group, doc, etag)?;
                membership.change_counter = counter.counter;
                self.remember_counter(group, counter);
            } else {
                let hb = parse_heartbeat(group, doc)?;
                if !etag.is_empty() {
                    lock(&self.inner.hosts)
                        .insert((group.clone(), hb.host.clone()), (hb.version, etag));
                }
                membership.hosts.push(hb);
            }
        }
        membership.hosts.sort_by(|a, b| a.host.cmp(&b.host));
        Ok(membership)
    }

    async fn head(&self, group: &GroupName) -> Result<Option<GroupHead>, LeaseError> {
        self.read_head(group).await.map(Some)
    }

    async fn write_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        self.put_view(group, view, expected).await
    }
}
